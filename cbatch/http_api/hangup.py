"""A caller that hangs up before its answer: the work done for it is cancelled, not finished
for nobody (a generation's choices, an embedding request's inputs not yet decoded)."""

import asyncio

from starlette.requests import Request


async def wait_disconnect(request: Request) -> None:
    """Returns when the client hangs up (the body has been read: receive() waits)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_hung_up(request: Request, work: asyncio.Future) -> tuple[bool, object]:
    """(True, work's result), or (False, None) when the caller hung up first: the work is
    then cancelled, and waited for until it has stopped."""
    watcher = asyncio.create_task(wait_disconnect(request))
    try:
        await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if work.done():
        return True, work.result()
    work.cancel()
    await asyncio.wait([work])
    return False, None
