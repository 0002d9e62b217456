"""Discrete-event mode: the service's own routing code against hundreds of simulated engines, no sockets."""
