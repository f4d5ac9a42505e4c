"""The control plane's wire format: length-prefixed JSON frames, and StepPlan <-> JSON.

JSON, not pickle: a frame can only ever become plain data (dicts, lists, numbers,
strings), so whoever manages to send one cannot make the receiver run code.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from runtime.core.plan import NewSeq, ScheduledSeq, StepPlan

_LEN = struct.Struct("<Q")
MAX_FRAME = 64 << 20  # a plan of max_num_tokens prompt ids is far smaller; refuse garbage


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_LEN.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the control connection")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> bytes:
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if n > MAX_FRAME:
        raise ConnectionError(f"control frame of {n} bytes exceeds {MAX_FRAME}")
    return recv_exact(sock, n)


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def loads(data: bytes) -> Any:
    return json.loads(data)


def plan_to_wire(plan: StepPlan) -> bytes:
    """A plan as compact JSON: positional lists, dict keys as [key, value] pairs."""
    return dumps([
        plan.step_id,
        [[s.seq_id, s.token_ids] for s in plan.new_seqs],
        list(plan.appended_tokens.items()),
        [[s.seq_id, s.num_computed_tokens, s.num_new_tokens, s.new_block_ids, s.sample,
          s.prompt_logits, s.draft_token_ids] for s in plan.scheduled],
        plan.freed_seq_ids,
        plan.shutdown,
        plan.copied_blocks,
        list(plan.accepted_tokens.items()),
        list(plan.block_table_lens.items()),
    ])


def plan_from_wire(data: bytes) -> StepPlan:
    step_id, new, appended, scheduled, freed, shutdown, copied, accepted, lens = loads(data)
    return StepPlan(
        step_id=int(step_id),
        new_seqs=[NewSeq(int(sid), [int(t) for t in toks]) for sid, toks in new],
        appended_tokens={int(sid): int(tok) for sid, tok in appended},
        scheduled=[ScheduledSeq(int(sid), int(done), int(n), [int(b) for b in blocks],
                                bool(sample), int(rows), [int(t) for t in drafts])
                   for sid, done, n, blocks, sample, rows, drafts in scheduled],
        freed_seq_ids=[int(s) for s in freed],
        shutdown=bool(shutdown),
        copied_blocks=[(int(a), int(b)) for a, b in copied],
        accepted_tokens={int(sid): [int(t) for t in toks] for sid, toks in accepted},
        block_table_lens={int(sid): int(n) for sid, n in lens},
    )
