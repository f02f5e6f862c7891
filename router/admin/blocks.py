"""``/admin/blocks/{model}/{hash}``: which workers and tiers hold one block, and its G4 file if any."""
from __future__ import annotations

from fastapi import APIRouter, Request

from router.admin import schemas
from router.admin.common import kv_state
from router.admin.g4 import g4_file_metadata
from router.errors import APIError, error_responses

router = APIRouter(prefix="/blocks", tags=["admin: blocks"])


def parse_hash(text: str) -> int:
    """A sequence hash as decimal (``12345``) or 0x-prefixed hex (``0x3039``; the API prints 16 hex digits
    in ``hash_hex``: prefix them with 0x). Bare hex is refused: 16 hex digits can all be decimal digits."""
    t = text.strip().lower()
    try:
        if t.startswith("0x"):
            value = int(t[2:], 16)
        else:
            value = int(t, 10)
    except ValueError:
        raise APIError(400, f"block hash {text!r} is neither a decimal integer nor 0x-prefixed hex",
                       param="hash", code="invalid_hash") from None
    if not 0 <= value < 1 << 64:
        raise APIError(400, f"block hash {text!r} is outside the unsigned 64-bit range", param="hash",
                       code="invalid_hash")
    return value


@router.get("/{model:path}/{block_hash}", response_model=schemas.BlockOut,
            responses=error_responses(400, 503),
            summary="Where one block lives (hash in decimal or 0x-hex)")
async def locate_block(model: str, block_hash: str, request: Request) -> schemas.BlockOut:
    state = kv_state(request)
    h = parse_hash(block_hash)
    try:
        loc = await state.index.locate(model, h)
    except Exception as exc:
        raise APIError(503, f"the index is unavailable: {type(exc).__name__}: {exc}",
                       code="index_unavailable") from None
    return schemas.BlockOut(
        model=model, hash=h, hash_hex=f"{h:016x}",
        workers={w: sorted(t.value for t in tiers) for w, tiers in sorted(loc.workers.items())},
        g4=bool(loc.g4), g4_file=await g4_file_metadata(state, model, h),
    )
