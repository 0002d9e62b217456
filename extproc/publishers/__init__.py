"""Publishers: scrape engines' /metrics, normalise per engine, and publish snapshots to Redis."""
