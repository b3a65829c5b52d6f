"""The wire layer's client tests run against the real services, started by the fixtures of
the services' own test folders."""

from tests.buffer.conftest import make_buffer
from tests.reward.conftest import reward_service

__all__ = ["make_buffer", "reward_service"]
