"""Who crashed the decode worker: read from the crash marks it left in the ring's header.

Each marking thread of the worker has its own mark (ipc/ring.py CrashMark): the decode loop's
sampling, each preparer's preparation (a request id), and llama_decode on the generation
context (the request ids of its batch, in the ring's roster) or the embeddings' (how many).
The rule, when the worker died of a crash signal:
  * Exactly one mark is set and it names a request: that request crashed the worker. It fails
    with `invalid_request`, and its shape is quarantined (quarantine.py).
  * Otherwise the crash is ambiguous (inside llama_decode, which computes for every request in
    its batch; inside the sampling's joint mask fill of several requests; several threads
    marked; or nothing marked) and no shape is quarantined. The
    suspects are the marked requests and those of the generation decode that ran; requests
    queued in the worker, or paused, were in no batch and are not suspects, nor is any
    generation request when only the embeddings' decode ran. When the roster could not hold
    the batch, a mark stood for several requests, or nothing was marked (the crash was outside
    every marked call), every request the worker held is a suspect. Suspects fail with
    `worker_restarted` like the rest of the dead worker's requests, and go on probation
    (probation.py), unless exactly one of them was on probation already: that request was a
    suspect of two crashes, and only it is quarantined, exactly (its fingerprint), failing
    with `invalid_request`.
Since at most one request on probation is in the worker at a time, a poison request that
keeps crashing llama_decode is caught at its second crash, and its innocent batch-mates
(resent by their callers) complete on probation and leave it.
"""

import logging

from cbatch.errors import INVALID_REQUEST
from cbatch.ipc.ring import CrashMarks
from cbatch.workers.daemon.quarantine import CRASHED_TWICE_MESSAGE, QUARANTINED_MESSAGE

log = logging.getLogger("cbatch.daemon")


def blame_crash(marks: CrashMarks, frontend) -> None:
    """Apply the rule above to the front-end's requests (before the rest fail)."""
    active = frontend.requests.active
    marked = [active[request_id] for request_id in marks.request_ids if request_id in active]
    if len(marks.request_ids) == 1 and not marks.is_decoding and not marks.is_several:
        for culprit in marked:
            log.error("decode worker crashed inside request %d; its shape is quarantined", culprit.request_id)
            frontend.quarantine.add(culprit.shape)
            frontend.fail(culprit, INVALID_REQUEST, QUARANTINED_MESSAGE)
        return
    is_all_suspect = marks.decoding_ids is None or marks.is_several or not (marks.is_decoding or marks.request_ids)
    if is_all_suspect:
        suspects = [tracked for tracked in active.values() if not tracked.is_held]
    else:
        marked_ids = {tracked.request_id for tracked in marked}
        suspects = marked + [active[request_id] for request_id in dict.fromkeys(marks.decoding_ids)
                             if request_id in active and request_id not in marked_ids]
    repeated = [tracked for tracked in suspects if tracked.fingerprint in frontend.probation]
    if len(repeated) == 1:
        culprit = repeated[0]
        log.error("decode worker crashed again with request %d on probation; that exact request is quarantined",
                  culprit.request_id)
        frontend.quarantine.add_request(culprit.fingerprint)
        frontend.fail(culprit, INVALID_REQUEST, CRASHED_TWICE_MESSAGE)
        suspects.remove(culprit)
    where = "inside llama_decode" if marks.is_decoding else f"with {len(marks.request_ids)} requests marked"
    log.error("decode worker crashed %s; %d requests go on probation, no shape is quarantined", where,
              len(suspects))
    frontend.probation.put(tracked.fingerprint for tracked in suspects)
