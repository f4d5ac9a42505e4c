"""The draft engine: a second engine that proposes tokens for speculative decoding
(`--speculative draft:ENGINE[:K]`, issue #36).

It runs on rank 0 only, at TP=1 (vLLM's choice for draft models too): a draft is small or
quantized, so splitting it across ranks would cost a collective per layer for a model
that is cheap anyway, and only rank 0 schedules. It needs the target's tokenizer (the
drafts are token ids the target verifies) and is checked for it (`check_draft`).

State. The draft keeps its own paged KV cache per sequence (its own `BlockManager`, its
own `ModelRunner` and thus the runner's per-sequence `SeqState`). `_computed[seq]` is the
number of positions whose KV in the draft cache matches the sequence. Each step:

    known tokens  t0 ............................. tn-1      (prompt + output, target's)
    draft cache   [ computed: KV of t0..tc-1 ][ stale: rejected drafts, old tokens ]
    this step     catch up tc..tn-1 (chunked like a prompt) -> d1; decode d1 -> d2 ... dK

`prepare` first truncates each sequence's draft state to the longest common prefix of
what it computed and the sequence's tokens now (the drafts the target rejected go; the
accepted ones and the target's token after them are then caught up), then drafts for all
candidates in one batch: catch-up passes (every sequence's uncomputed tokens in one step,
a sequence sampling d1 in the pass its catch-up ends), then K - 1 decode passes of one
token per sequence. `propose` hands out the cached drafts cut to the k the step allows.
Greedy: each draft is the argmax of the draft's row.

The draft's logits rows (float32, [k, vocab]) are kept per sequence when `keep_logits`
is set: the q distribution that rejection sampling of sampled requests needs
(`draft_logits`); greedy acceptance does not use them.

Memory: the cache is sized by the serving job at its allocate gate (serve/backends/
torch.py) to hold as many tokens as the target's plus K per sequence, so that the draft
never runs out before the target does; if it does, states of sequences not drafting this
step are dropped first, and a sequence that still does not fit drafts nothing this step.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from contract.manifest import Manifest, read_manifest
from contract.speculative import Speculative
from runtime.core.kv_cache import BlockManager
from runtime.core.plan import ScheduledSeq, StepPlan
from runtime.executors.runner import ModelRunner, SeqState
from runtime.executors.torch import runner_from_engine
from runtime.host import host_matches
from runtime.models.config import ModelConfig
from runtime.models.parallel import TPContext
from runtime.store.checkpoint import load_engine_model_config
from runtime.store.files import EngineFiles

DRAFT_BACKENDS = ("aoti", "eager")
# The files that map text to ids (a chat template or generation config may differ: the
# ids the draft proposes are what must mean the same).
VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt")


def common_prefix(a: Sequence[int], b: Sequence[int], n: int) -> int:
    """The length of the common prefix of a[:n] and b[:n] (n at most both lengths). The
    usual case, all n equal, is one slice comparison in C."""
    n = min(n, len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    i = 0
    while a[i] == b[i]:
        i += 1
    return i


@dataclass(slots=True)
class DraftStats:
    passes: int = 0  # model steps the draft ran
    seconds: float = 0.0  # in prepare, all of it
    tokens: int = 0  # positions computed (catch-up and decode)
    drafted: int = 0  # draft tokens proposed (cached, before the step's cut)


class DraftEngineDrafter:
    """`runtime.core.spec.Drafter` over a draft engine's runner (rank 0, TP=1)."""

    name = "draft"

    def __init__(self, runner: ModelRunner, num_tokens: int, num_blocks: int,
                 max_num_tokens: int, keep_logits: bool = False) -> None:
        """`num_blocks`: the runner's KV cache's blocks (the null block included);
        `max_num_tokens`: the draft engine's step bound (its build profile's)."""
        self.runner = runner
        # A draft's catch-up after a verify step is a "prompt" chunk of 2 .. K + 1 tokens
        # per sequence: padded to the runner's token bucket it would cost the compute of a
        # 16-token step every step (as verify rows did, runner.py). Steps up to a whole
        # bucket keep their exact shape: still a bounded set of shapes.
        runner.pad_from = max(runner.pad_from, runner.token_bucket)
        self.num_tokens = num_tokens
        self.max_num_tokens = max_num_tokens
        self.blocks = BlockManager(num_blocks, runner.block_size)
        self.keep_logits = keep_logits
        self.stats = DraftStats()
        self.keepalive: object = None  # what the runner's files are (verified copies)
        self._computed: dict[int, int] = {}
        self._drafts: dict[int, list[int]] = {}
        self._logits: dict[int, list[torch.Tensor]] = {}

    # ---- the Drafter protocol ------------------------------------------------------------

    def prepare(self, candidates: Sequence[tuple[int, Sequence[int], int]]) -> None:
        t0 = time.perf_counter()
        self._drafts.clear()
        self._logits.clear()
        live = {sid for sid, _, _ in candidates}
        work: list[tuple[int, int]] = []  # (seq id, k)
        for sid, tokens, k in candidates:
            k = min(k, self.num_tokens)
            if k < 1 or not tokens:
                continue
            if self._catch_up_state(sid, tokens, k, live):
                work.append((sid, k))
        if work:
            self._run(work)
        self.stats.seconds += time.perf_counter() - t0

    def propose(self, token_ids: Sequence[int], k: int | None = None,
                seq_id: int | None = None) -> list[int]:
        drafts = self._drafts.get(seq_id, []) if seq_id is not None else []
        state = self.runner.seqs.get(seq_id) if seq_id is not None else None
        # Drafts were made for exactly these tokens (prepare ran this step); else none.
        if not drafts or state is None or len(state.token_ids) - len(drafts) != len(token_ids):
            return []
        return drafts[:self.num_tokens if k is None else k]

    def forget(self, seq_id: int) -> None:
        state = self.runner.seqs.pop(seq_id, None)
        if state is not None:
            self.blocks.free(reversed(state.block_table))
        self._computed.pop(seq_id, None)
        self._drafts.pop(seq_id, None)
        self._logits.pop(seq_id, None)

    # ---- hooks -----------------------------------------------------------------------

    def draft_logits(self, seq_id: int) -> torch.Tensor | None:
        """The draft's float32 logits rows for this step's drafts ([k, vocab], row i the
        distribution draft i was taken from), with `keep_logits`; None otherwise."""
        rows = self._logits.get(seq_id)
        return torch.stack(rows) if rows else None

    def computed(self, seq_id: int) -> int:
        """Positions of the sequence whose KV the draft cache holds (tests, metrics)."""
        return self._computed.get(seq_id, 0)

    # ---- internals -------------------------------------------------------------------

    def _catch_up_state(self, sid: int, tokens: Sequence[int], k: int, live: set[int]) -> bool:
        """Truncate the sequence's draft state to what still matches `tokens` and give it
        the blocks for this step's positions (tokens, and drafts 1..k-1); False when the
        draft cache has no room for it now."""
        bm = self.blocks
        state = self.runner.seqs.get(sid)
        if state is None:
            state = self.runner.seqs[sid] = SeqState([])
        # The last known token is never computed before drafting: its row gives draft 1.
        c = common_prefix(state.token_ids, tokens,
                          min(self._computed.get(sid, 0), len(tokens) - 1))
        keep = bm.blocks_needed(c)
        if len(state.block_table) > keep:  # tail blocks of rejected positions
            bm.free(reversed(state.block_table[keep:]))
            del state.block_table[keep:]
        state.token_ids = list(tokens)
        self._computed[sid] = c
        need = bm.blocks_needed(len(tokens) + k - 1) - len(state.block_table)
        if not bm.can_allocate(need):
            for other in [s for s in self.runner.seqs if s not in live]:
                self.forget(other)
            if not bm.can_allocate(need):
                return False
        state.block_table.extend(bm.allocate(need))
        return True

    def _step(self, entries: list[ScheduledSeq]) -> dict[int, torch.Tensor]:
        """One draft step; each sampling entry's float32 logits row by seq id."""
        ids, logits = self.runner.execute(StepPlan(step_id=self.stats.passes, scheduled=entries))
        self.stats.passes += 1
        self.stats.tokens += sum(e.num_new_tokens for e in entries)
        if not ids or logits is None:  # a catch-up chunk that samples nothing
            return {}
        return {sid: logits[i].float() for i, sid in enumerate(ids)}

    def _take(self, rows: dict[int, torch.Tensor]) -> None:
        """Greedy drafts from the rows: appended to the sequence's draft tokens (the next
        decode pass reads them from there)."""
        for sid, row in rows.items():
            token = int(torch.argmax(row))
            self._drafts.setdefault(sid, []).append(token)
            self.runner.seqs[sid].token_ids.append(token)
            if self.keep_logits:
                self._logits.setdefault(sid, []).append(row)

    def _run(self, work: list[tuple[int, int]]) -> None:
        seqs = self.runner.seqs
        cap = self.max_num_tokens
        # Catch-up: every sequence's uncomputed tokens, chunked within the step bound; a
        # sequence samples draft 1 in the pass where its last known token is computed.
        pending = [sid for sid, _ in work]
        while pending:
            entries, budget, rest = [], cap, []
            for sid in pending:
                start, end = self._computed[sid], len(seqs[sid].token_ids)
                n = min(end - start, budget)
                if n < 1:
                    rest.append(sid)
                    continue
                entries.append(ScheduledSeq(sid, start, n, [], sample=start + n == end))
                budget -= n
                self._computed[sid] = start + n
                if start + n < end:
                    rest.append(sid)
            self._take(self._step(entries))
            pending = rest
        # Decode: draft i + 1 from draft i, all sequences that want it in one step.
        for i in range(1, max(k for _, k in work)):
            batch = [sid for sid, k in work if k > i]
            for at in range(0, len(batch), cap):
                entries = []
                for sid in batch[at:at + cap]:
                    pos = self._computed[sid]
                    entries.append(ScheduledSeq(sid, pos, 1, [], sample=True))
                    self._computed[sid] = pos + 1
                self._take(self._step(entries))
        self.stats.drafted += sum(k for _, k in work)


# ---- loading and checking a draft engine ------------------------------------------------


class DraftEngineError(ValueError):
    """A draft engine that cannot draft for this target: the cause, and the remedy."""

    def __init__(self, cause: str, remedy: str) -> None:
        super().__init__(f"{cause}; {remedy}")
        self.cause, self.remedy = cause, remedy


def open_draft(spec: Speculative) -> tuple[Path, Manifest, ModelConfig]:
    """The draft engine's directory, manifest and model config, or DraftEngineError."""
    assert spec.method == "draft" and spec.engine
    path = Path(spec.engine).expanduser()
    remedy = "give --speculative draft:ENGINE_DIR[:K] a built engine's directory"
    if not (path / "manifest.json").is_file():
        raise DraftEngineError(f"the draft engine {path} has no manifest.json", remedy)
    try:
        m = read_manifest(path)
        cfg = load_engine_model_config(path)
    except (OSError, ValueError, KeyError) as e:
        raise DraftEngineError(f"the draft engine {path} cannot be read ({e})", remedy) from None
    if spec.engine_id is not None and m.engine_id != spec.engine_id:
        raise DraftEngineError(
            f"the draft engine at {path} is {m.engine_id}, not the {spec.engine_id} this "
            "engine was built with", "rebuild with `pipeline build --speculative draft:...`, "
            "or give `serve launch --speculative draft:ENGINE_DIR[:K]`")
    return path, m, cfg


def vocab_hashes(manifest: Manifest) -> dict[str, str]:
    """The sha256 of each file of an engine that maps text to ids (VOCAB_FILES)."""
    return {f.path: f.sha256 for f in manifest.files if f.path in VOCAB_FILES}


def vocab_hashes_of(directory: Path) -> dict[str, str]:
    """The same for a checkpoint directory (the build's source)."""
    return {n: hashlib.sha256((directory / n).read_bytes()).hexdigest()
            for n in VOCAB_FILES if (directory / n).is_file()}


def check_draft(draft: Manifest, draft_cfg: ModelConfig, draft_dir: Path, num_tokens: int, *,
                device: str, vocab_size: int, vocab: dict[str, str],
                check_host: bool = True) -> None:
    """DraftEngineError unless the draft can draft for a target (on `device`, with
    `vocab_size` ids and `vocab` its VOCAB_FILES' digests) here: TP=1, a torch backend,
    built for this host (and this torch when compiled), the same vocabulary and tokenizer
    files, and K + 1 tokens within its step bound."""
    where = f"the draft engine {draft_dir}"
    if draft.tp != 1:
        raise DraftEngineError(f"{where} is TP={draft.tp}; a draft runs on rank 0 alone",
                               "rebuild it with `pipeline build --tp 1`")
    if draft.backend not in DRAFT_BACKENDS:
        raise DraftEngineError(f"{where} is a {draft.backend} engine",
                               "rebuild it with --backend aoti or eager")
    if check_host:
        ok, why = host_matches(draft.target.to_dict())
        if not ok:
            raise DraftEngineError(f"{where}: {why}", "rebuild it on this host")
        built = draft.toolchain.get("torch")
        if draft.backend == "aoti" and built != torch.__version__:
            raise DraftEngineError(f"{where}'s kernels were compiled by torch {built}, this "
                                   f"host runs {torch.__version__}", "rebuild it on this host")
    if draft.target.device != device:
        raise DraftEngineError(f"{where} runs on {draft.target.device}, the engine on "
                               f"{device}", "build both for the same target")
    same = "draft with an engine built from a checkpoint with the engine's tokenizer"
    if draft_cfg.vocab_size != vocab_size:
        raise DraftEngineError(f"{where} has a vocabulary of {draft_cfg.vocab_size} ids, the "
                               f"engine {vocab_size}", same)
    theirs = vocab_hashes(draft)
    for name, digest in vocab.items():
        if theirs.get(name) != digest:
            raise DraftEngineError(f"{where}'s {name} differs from the engine's", same)
    if num_tokens + 1 > draft.profile.max_num_tokens:
        raise DraftEngineError(f"K={num_tokens} drafts need {num_tokens + 1} tokens a step, "
                               f"{where} computes {draft.profile.max_num_tokens}", "lower K")


def pin_draft(spec: Speculative, device: str, vocab_size: int,
              vocab: dict[str, str]) -> Speculative:
    """`pipeline build --speculative draft:...`: the draft checked against the engine being
    built, recorded by absolute path and engine id (a server refuses another engine found
    at that path later)."""
    path, m, cfg = open_draft(spec)
    check_draft(m, cfg, path, spec.num_tokens, device=device, vocab_size=vocab_size,
                vocab=vocab)
    return dataclasses.replace(spec, engine=str(path.resolve()), engine_id=m.engine_id)


def load_draft(spec: Speculative, path: Path, manifest: Manifest, num_blocks: int,
               device: str = "cpu", keep_logits: bool = False) -> DraftEngineDrafter:
    """The drafter over the draft engine's runner: every file read is checked against its
    manifest (runtime/store/files.py, the shard hashed while it is read), as the target's
    are; its KV cache holds `num_blocks` blocks (the null block included)."""
    p = manifest.profile
    files = EngineFiles(path, manifest)
    runner, _ = runner_from_engine(path, manifest.backend, manifest.dtype, TPContext(),
                                   num_blocks, p.tokens_per_block, p.max_num_tokens, device,
                                   files=files)
    drafter = DraftEngineDrafter(runner, spec.num_tokens, num_blocks, p.max_num_tokens,
                                 keep_logits)
    drafter.keepalive = files
    return drafter
