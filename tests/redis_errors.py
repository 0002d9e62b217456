"""What a Redis client's first command raises, for the tests that check refusals and doctor's hints."""

from __future__ import annotations

import pytest

from extproc.fleet.redis_feed import redis_client
from extproc.settings import RedisSettings


async def ping_error(settings: RedisSettings, expected: type[BaseException]) -> BaseException:
    """PING through a client for `settings`, which must raise `expected`; the client is closed."""
    client = redis_client(settings)
    try:
        with pytest.raises(expected) as err:
            await client.ping()
    finally:
        await client.aclose()
    return err.value
