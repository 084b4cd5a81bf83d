"""One mapping from handler errors to gRPC status codes, for unary and streamed RPCs alike."""

import asyncio

import grpc
import pytest

from kvstore.daemon.budget import BudgetExhausted
from kvstore.daemon.holds import HoldRefused
from kvstore.daemon.reads import BlockGoneError
from kvstore.daemon.server import _abort
from kvstore.daemon.transfers import BadRequest
from tiers.base import TierError, TierFullError, TierUnavailableError


class Aborted(Exception):
    pass


class Context:
    """Records the status a handler ends with (grpc's abort raises; so does this)."""

    async def abort(self, code, details):
        self.code, self.details = code, details
        raise Aborted


@pytest.mark.parametrize("exc, code", [
    (BadRequest(grpc.StatusCode.NOT_FOUND, "gone"), grpc.StatusCode.NOT_FOUND),
    (ValueError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
    (BlockGoneError("left"), grpc.StatusCode.ABORTED),
    (TierFullError("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (HoldRefused("held"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (BudgetExhausted("busy"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (TierUnavailableError("down"), grpc.StatusCode.UNAVAILABLE),
    (TierError("io"), grpc.StatusCode.UNAVAILABLE),
    (KeyError("bug"), grpc.StatusCode.INTERNAL),
])
def test_each_error_kind_has_one_status(exc, code):
    context = Context()
    with pytest.raises(Aborted):
        asyncio.run(_abort(context, "GetLayers", exc))
    assert context.code == code
    assert (str(exc) in context.details) and (code != grpc.StatusCode.INTERNAL or "GetLayers: KeyError" in context.details)
