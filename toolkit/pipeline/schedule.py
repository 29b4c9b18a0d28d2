"""Pipeline schedules as data: per-rank lists of actions, and the generators that build them.

One model serves three uses: the simulator (``simulate.py``) times it from op costs, the executor
(``executor.py``) runs it for real on p processes, and the figures draw it. A schedule says *what* each
rank does and in which order; *when* follows from the dependencies (``Schedule.deps``) and the costs.

Actions (``Action.op``; the names are torch.distributed.pipelining's)::

    F    forward of one (stage, micro-batch, sequence chunk)
    B    full backward: input gradient dX and weight gradient dW together
    I    input-gradient backward only (dX); its dW is deferred to a later W   (zero-bubble split)
    W    weight-gradient backward of an earlier I
    FB   an F of one micro-batch and a B of another, issued together so that one's compute hides the
         other's communication (DualPipe's F&B); ``sub = (F action, B-or-I action)``
    R    recompute: rebuild the activations of a checkpointed F before its backward
    S, T vocabulary-parallel output-layer passes (used by ``vocab_parallel``); any other op name works too
         if a subclass of ``Schedule`` gives it dependencies and the costs give it a duration

    str(Action("F", stage=3, mb=1)) == "3F1"     (torch's format: stage, op, micro-batch)
    str(Action("F", 3, 1, chunk=2)) == "3F1.2"   (Seq1F1B: sequence chunk after the dot)

Sends and receives are not written by the generators: every dependency that crosses ranks is one message,
so ``Schedule.recvs`` / ``Schedule.sends`` derive them, and ``Schedule.with_comms(rank)`` shows a rank's
list with them in place (torch's ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B``), as the executor runs it:
a receive posted one compute action ahead of the action that needs it, a send right after the producer.

Layouts (``stage_rank[stage] -> rank``), for p ranks::

    linear       p stages        rank r holds stage r                          GPipe, 1F1B, ZB-H1
    interleaved  v*p stages      rank r holds stages r, r+p, ..., r+(v-1)p     interleaved 1F1B
    v            2p stages       rank r holds stages r and 2p-1-r              DualPipeV, ZB-V

    v layout, p = 4:   rank 0: stage 0 ──────────────────────────── stage 7 (loss)
                       rank 1:   stage 1 ──────────────────── stage 6
                       rank 2:     stage 2 ──────────── stage 5
                       rank 3:       stage 3 ── stage 4           (the turn of the V stays on one rank)

Dependencies (``Schedule.deps``), each naming the action that must finish first::

    F(s, mb, c)   <- F(s-1, mb, c)                 activation from the previous stage
                  <- F(s, mb, c-1)                 Seq1F1B: chunk c attends to the K/V of chunks < c
    B|I(s, mb, c) <- F(s, mb, c)                   its own forward (or R(s, mb, c) if checkpointed)
                  <- B|I(s+1, mb, c)               gradient from the next stage
                  <- B|I(s, mb, c+1)               Seq1F1B: chunk c+1's K/V gradient flows into chunk c
    W(s, mb, c)   <- I(s, mb, c)
    R(s, mb, c)   <- F(s, mb, c)

Generators (all return a checked ``Schedule``): ``gpipe``, ``one_f_one_b`` and ``interleaved_1f1b`` (both
optionally with recompute inline or in the bubbles, ``with_recompute``), ``zb_h1``, ``dualpipev``
(DeepSeek's eight steps), and ``from_torch`` (any schedule torch.distributed.pipelining defines, e.g. ZBVZeroBubble), all reachable by
name through ``make_schedule``.
"""
from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import cached_property

COMPUTE_OPS = ("F", "B", "I", "W", "FB", "R")
COMM_OPS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")  # F = activation (forward), B = gradient (backward)
BACKWARD_OPS = ("B", "I")  # the ops that carry the input gradient to the previous stage
Key = tuple[int, int, int]  # (stage, micro-batch, sequence chunk)


@dataclass(frozen=True)
class Action:
    """One step of one rank: ``op`` on (``stage``, micro-batch ``mb``, sequence ``chunk``).

    ``FB`` actions have ``stage = mb = -1`` and carry their two halves in ``sub`` (forward first).
    """

    op: str
    stage: int = -1
    mb: int = -1
    chunk: int = 0
    sub: tuple["Action", ...] = ()

    def __str__(self) -> str:
        if self.sub:
            return "(" + ";".join(map(str, self.sub)) + ")" + self.op
        return f"{self.stage}{self.op}{self.mb}" + (f".{self.chunk}" if self.chunk else "")

    __repr__ = __str__

    @property
    def parts(self) -> tuple["Action", ...]:
        """The single actions this one runs: its two halves for FB, itself otherwise."""
        return self.sub if self.sub else (self,)

    @property
    def key(self) -> tuple[str, int, int, int]:
        """What other actions depend on: B and I both deliver the input gradient, so both are "bwd"."""
        return ("bwd" if self.op in BACKWARD_OPS else self.op, self.stage, self.mb, self.chunk)


def fb(forward: Action, backward: Action) -> Action:
    """An overlapped F&B: the forward of one micro-batch and the backward of another, issued together."""
    if forward.op != "F" or backward.op not in BACKWARD_OPS:
        raise ValueError(f"FB needs an F and a B or I, got {forward} and {backward}")
    return Action("FB", sub=(forward, backward))


# ------------------------------------------------------------------------------------------------
# The schedule
# ------------------------------------------------------------------------------------------------
@dataclass
class Schedule:
    """Per-rank action lists plus where each stage lives.

    Attributes:
        name: e.g. ``"1f1b"``.
        ranks: ``ranks[r]`` is rank r's actions in execution order.
        stage_rank: ``stage_rank[s]`` is the rank that holds stage (model chunk) ``s``; stage 0 takes the
            tokens, the last stage computes the loss.
        m: micro-batches per step.
        k: sequence chunks per micro-batch (Seq1F1B); 1 otherwise.
        checkpointed: (stage, mb, chunk) whose forward keeps no activations. If the rank's list has an
            ``R`` for it the recompute runs there (e.g. in a bubble); otherwise the backward recomputes
            inline first, as ``torch.utils.checkpoint`` does.
        meta: free-form facts about how it was built (v, keep, ...).

    Treat a built schedule as immutable. Subclasses can give new ops dependencies by overriding ``deps``
    (call ``super().deps`` for the rest).
    """

    name: str
    ranks: list[list[Action]]
    stage_rank: tuple[int, ...]
    m: int
    k: int = 1
    checkpointed: frozenset = frozenset()
    meta: dict = field(default_factory=dict)

    @property
    def p(self) -> int:
        return len(self.ranks)

    @property
    def n_stages(self) -> int:
        return len(self.stage_rank)

    @property
    def stages_per_rank(self) -> int:
        return self.n_stages // self.p

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_rank) if r == rank]

    def deps(self, a: Action) -> list[tuple[str, int, int, int]]:
        """Keys (``Action.key``) of the actions that must finish before single action ``a`` starts."""
        s, mb, c, last = a.stage, a.mb, a.chunk, self.n_stages - 1
        if a.op == "F":
            return ([("F", s - 1, mb, c)] if s > 0 else []) + ([("F", s, mb, c - 1)] if c > 0 else [])
        if a.op in BACKWARD_OPS:
            own = ("R" if (s, mb, c) in self.recomputed else "F", s, mb, c)
            return ([own] + ([("bwd", s + 1, mb, c)] if s < last else [])
                    + ([("bwd", s, mb, c + 1)] if c < self.k - 1 else []))
        if a.op == "W":
            return [("bwd", s, mb, c)]
        if a.op == "R":
            return [("F", s, mb, c)]
        raise ValueError(f"no dependency rule for op {a.op!r}; subclass Schedule and override deps()")

    @cached_property
    def recomputed(self) -> set[tuple[int, int, int]]:
        """(stage, mb, chunk) that have an explicit R action (the other checkpointed ones recompute inline)."""
        return {(a.stage, a.mb, a.chunk) for acts in self.ranks for a in acts if a.op == "R"}

    def check(self) -> "Schedule":
        """Raise ValueError unless every (stage, mb, chunk) has one F and one backward on its stage's rank,
        every I has exactly one W, every R belongs to a checkpointed forward, and no action repeats."""
        seen: dict[tuple, int] = defaultdict(int)
        for r, acts in enumerate(self.ranks):
            for a in acts:
                for part in a.parts:
                    if part.op in COMPUTE_OPS and self.stage_rank[part.stage] != r:
                        raise ValueError(f"{self.name}: {part} is on rank {r} but stage {part.stage} lives on "
                                         f"rank {self.stage_rank[part.stage]}")
                    seen[(part.op, part.stage, part.mb, part.chunk)] += 1
        for (op, s, mb, c), n in seen.items():
            if n > 1:
                raise ValueError(f"{self.name}: {Action(op, s, mb, c)} occurs {n} times")
            if op == "I" and seen.get(("W", s, mb, c), 0) != 1:
                raise ValueError(f"{self.name}: {Action(op, s, mb, c)} has no W")
            if op == "W" and seen.get(("I", s, mb, c), 0) != 1:
                raise ValueError(f"{self.name}: {Action(op, s, mb, c)} has no I before it")
            if op == "R" and (s, mb, c) not in self.checkpointed:
                raise ValueError(f"{self.name}: {Action(op, s, mb, c)} recomputes a forward that kept its activations")
        for s in range(self.n_stages):
            for mb in range(self.m):
                for c in range(self.k):
                    nb = seen.get(("B", s, mb, c), 0) + seen.get(("I", s, mb, c), 0)
                    if seen.get(("F", s, mb, c), 0) != 1 or nb != 1:
                        raise ValueError(f"{self.name}: stage {s} micro-batch {mb} chunk {c} has "
                                         f"{seen.get(('F', s, mb, c), 0)} F and {nb} backward (need 1 and 1)")
        return self

    def recvs(self, a: Action) -> list[Action]:
        """The messages single action ``a`` must receive from other ranks (RECV_F: its input activation,
        RECV_B: the gradient of its output), each on ``a``'s stage."""
        s, sr, r = a.stage, self.stage_rank, self.stage_rank[a.stage]
        if a.op == "F" and s > 0 and sr[s - 1] != r:
            return [Action("RECV_F", s, a.mb, a.chunk)]
        if a.op in BACKWARD_OPS and s < self.n_stages - 1 and sr[s + 1] != r:
            return [Action("RECV_B", s, a.mb, a.chunk)]
        return []

    def sends(self, a: Action) -> list[Action]:
        """The messages single action ``a`` sends to other ranks (SEND_F: its output, SEND_B: its input's
        gradient), each on ``a``'s stage."""
        s, sr, r = a.stage, self.stage_rank, self.stage_rank[a.stage]
        if a.op == "F" and s < self.n_stages - 1 and sr[s + 1] != r:
            return [Action("SEND_F", s, a.mb, a.chunk)]
        if a.op in BACKWARD_OPS and s > 0 and sr[s - 1] != r:
            return [Action("SEND_B", s, a.mb, a.chunk)]
        return []

    def with_comms(self, rank: int) -> list[Action]:
        """Rank ``rank``'s actions with its sends and receives in place, in the executor's order."""
        acts, out, posted = self.ranks[rank], [], set()
        for i, a in enumerate(acts):
            for nxt in acts[i:i + 2]:  # receives of this action and the next one are posted first
                for msg in (m for part in nxt.parts for m in self.recvs(part)):
                    if msg not in posted:
                        posted.add(msg)
                        out.append(msg)
            out.append(a)
            out += [m for part in a.parts for m in self.sends(part)]
        return out

    def to_strings(self) -> list[list[str]]:
        """``[["0F0", "0F1", "0B0", ...], ...]``: one list per rank, torch's notation."""
        return [[str(a) for a in acts] for acts in self.ranks]

    def table(self) -> str:
        """The per-rank orders as fixed-width text, one line per rank (no timing: see ``simulate``)."""
        cells = self.to_strings()
        width = max(len(c) for row in cells for c in row) + 1
        return "\n".join(f"rank {r}: " + "".join(c.ljust(width) for c in row) for r, row in enumerate(cells))


# ------------------------------------------------------------------------------------------------
# Layouts
# ------------------------------------------------------------------------------------------------
def linear_layout(p: int) -> tuple[int, ...]:
    return tuple(range(p))


def interleaved_layout(p: int, v: int) -> tuple[int, ...]:
    return tuple(s % p for s in range(v * p))


def v_layout(p: int) -> tuple[int, ...]:
    return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))


def _need(name: str, value, low: int, why: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an int >= {low}{why}, got {value!r}")


# ------------------------------------------------------------------------------------------------
# Generators
# ------------------------------------------------------------------------------------------------
def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards (torch's ScheduleGPipe order). Holds all m micro-batches."""
    _need("p", p, 1)
    _need("m", m, 1)
    ranks = [[Action("F", r, i) for i in range(m)] + [Action("B", r, i) for i in range(m)] for r in range(p)]
    return Schedule("gpipe", ranks, linear_layout(p), m).check()


def _one_f_one_b_order(p: int, m: int, r: int, backward: str = "B") -> list[Action]:
    """Rank r: p-r-1 warm-up forwards, then (F, B) pairs, then the remaining backwards."""
    warmup = min(p - r - 1, m)
    acts = [Action("F", r, i) for i in range(warmup)]
    for i in range(m - warmup):
        acts += [Action("F", r, warmup + i), Action(backward, r, i)]
    acts += [Action(backward, r, i) for i in range(m - warmup, m)]
    return acts


def one_f_one_b(p: int, m: int, recompute: str = "none", keep: int | None = None, policy: str = "cap") -> Schedule:
    """1F1B (PipeDream-flush): bubble (p-1)(F+B), rank r holds p-r micro-batches.

    ``recompute`` checkpoints forwards (``with_recompute``): with ``policy="cap"`` so that each rank
    holds at most ``keep`` micro-batches' activations at once (default ``ceil(p/2)``), counting the one a
    recompute rebuilds; with ``policy="cooldown"`` exactly those whose backward runs in the rank's cool-down.

    - ``"none"``: no checkpointing.
    - ``"inline"``: the backward recomputes first, after its gradient arrived (``torch.utils.checkpoint``).
    - ``"bubble"``: an explicit ``R`` right before the backward; it needs no gradient, so it runs while the
      rank would wait for one (cool-down bubbles, gradient in flight): recompute in the bubble (RiPipe).
    """

    _need("p", p, 1)
    _need("m", m, p, " (1F1B needs at least p micro-batches)")
    base = Schedule("1f1b", [_one_f_one_b_order(p, m, r) for r in range(p)], linear_layout(p), m).check()
    if recompute == "none" and policy == "cap":
        keep = -(-p // 2) if keep is None else keep
        _need("keep", keep, 1)
        base.meta.update({"recompute": "none", "keep": keep})
        return base
    return with_recompute(base, recompute, policy, keep)


def interleaved_1f1b(p: int, m: int, v: int = 2, recompute: str = "none", keep: int | None = None,
                     policy: str = "cap") -> Schedule:
    """Megatron's interleaved 1F1B with v stages per rank: bubble (p-1)(F+B)/v with per-rank F, B.

    Rank r warms up with (v-1)p + 2(p-r-1) forwards. The k-th forward runs stage chunk (k // p) % v of
    micro-batch (k // pv) * p + k % p; backwards walk the chunks in reverse. Needs m % p == 0. ``recompute``,
    ``keep`` (stage-chunks held) and ``policy`` as for ``one_f_one_b`` (``with_recompute``).
    """

    return with_recompute(_interleaved(p, m, v), recompute, policy, keep)


def _interleaved(p: int, m: int, v: int) -> Schedule:
    """``interleaved_1f1b`` without recompute."""
    _need("p", p, 1)
    _need("v", v, 2, " (v = 1 is plain 1F1B)")
    _need("m", m, p, " (interleaved 1F1B needs at least p micro-batches)")
    if m % p:
        raise ValueError(f"m={m} must be a multiple of p={p} for interleaved 1F1B")
    total = v * m

    def unit(k: int, backward: bool) -> tuple[int, int]:
        local = (k // p) % v
        return (v - 1 - local if backward else local), (k // (p * v)) * p + k % p

    ranks = []
    for r in range(p):
        warmup = min((v - 1) * p + 2 * (p - r - 1), total)
        fwd = [Action("F", c * p + r, mb) for c, mb in (unit(k, False) for k in range(total))]
        bwd = [Action("B", c * p + r, mb) for c, mb in (unit(k, True) for k in range(total))]
        acts = fwd[:warmup]
        for i in range(total - warmup):
            acts += [fwd[warmup + i], bwd[i]]
        ranks.append(acts + bwd[total - warmup:])
    return Schedule("interleaved", ranks, interleaved_layout(p, v), m, meta={"v": v}).check()


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al., ICLR 2024): 1F1B with the backward split into I (dX) and W (dW).

    Rank r runs 1F1B's order with I in place of B; each W follows its I except that rank r keeps r W
    back during the steady state, and its cool-down runs them late, so the input gradient reaches
    earlier ranks sooner. Bubble (p-1)(F+B-2W) (B = I + W), memory p micro-batches like 1F1B.
    """
    _need("p", p, 1)
    _need("m", m, p, " (ZB-H1 needs at least p micro-batches)")
    ranks = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [Action("F", r, i) for i in range(warmup)]
        pending: list[int] = []
        lag = min(r, m - warmup)  # W kept back on rank r
        for i in range(m - warmup):
            acts += [Action("F", r, warmup + i), Action("I", r, i)]
            pending.append(i)
            if len(pending) > lag:
                acts.append(Action("W", r, pending.pop(0)))
        for i in range(m - warmup, m):
            acts.append(Action("I", r, i))
            pending.append(i)
            acts.append(Action("W", r, pending.pop(0)))
        acts += [Action("W", r, i) for i in pending]
        ranks.append(acts)
    return Schedule("zb-h1", ranks, linear_layout(p), m).check()


def dualpipev(p: int, m: int, pair: bool = True) -> Schedule:
    """DualPipeV (DeepSeek's ``dualpipev.py``): 2p stages in a V, the eight steps per rank r.

    Stage r is rank r's phase 0, stage 2p-1-r its phase 1 ("F0" = forward of phase 0 ...). I is a
    backward with W deferred; W pops the oldest deferred one (WeightGradStore is a FIFO)::

        1. 2(p-r-1) x F0
        2. (r+1) x [F0, F1]
        3. (p-r-1) x [I1, W, F1]
        4. (m-2p+r+1) x [F0&B1, F1&B0]   (last rank: its first F0, B1 not overlapped)
        5. (p-r-1) x [B1, F1&B0]
        6. (r+1) x [B1, B0]                  zero-bubble split switched on at i = (r+1)//2:
                                             before B1 on odd ranks, before B0 on even ranks
        7. (p-r-1) x [W, B0 (as I if split on)]
        8. (r+1) x W

    Needs m >= 2p. Bubble (p-1)(F&B + B - 3W) per chunk costs; the same order as torch's ScheduleDualPipeV.
    ``pair=False`` gives the same order with every F&B written as its F, then its B, as two actions
    (named ``dualpipev-unpaired``: what the pairing itself changes can be measured against it).
    """
    if not isinstance(pair, bool):
        raise ValueError(f"pair must be True or False, got {pair!r}")
    _need("p", p, 1)
    _need("m", m, NEEDS["dualpipev"].min_m * p, f" (DualPipeV: {NEEDS['dualpipev'].why})")  # its rule, said once
    together = fb if pair else (lambda f, b: [f, b])
    ranks = []
    for r in range(p):
        s0, s1 = r, 2 * p - 1 - r
        acts: list[Action] = []
        nxt: dict[tuple[str, int], int] = defaultdict(int)  # next micro-batch per (kind, stage)
        deferred: list[Action] = []

        def take(kind: str, stage: int) -> int:
            nxt[(kind, stage)] += 1
            return nxt[(kind, stage)] - 1

        def f(stage: int) -> Action:
            return Action("F", stage, take("F", stage))

        def b(stage: int, split: bool = False) -> Action:
            a = Action("I" if split else "B", stage, take("bwd", stage))
            if split:
                deferred.append(Action("W", stage, a.mb))
            return a

        def w() -> None:
            if deferred:
                acts.append(deferred.pop(0))

        acts += [f(s0) for _ in range(2 * (p - r - 1))]                      # 1
        for _ in range(r + 1):                                                # 2
            acts += [f(s0), f(s1)]
        for _ in range(p - r - 1):                                            # 3
            acts.append(b(s1, split=True))
            w()
            acts.append(f(s1))
        for i in range(m - 2 * p + r + 1):                                    # 4
            if i == 0 and r == p - 1:
                acts += [f(s0), b(s1)]
            else:
                acts += _listed(together(f(s0), b(s1)))
            acts += _listed(together(f(s1), b(s0)))
        for _ in range(p - r - 1):                                            # 5
            acts.append(b(s1))
            acts += _listed(together(f(s1), b(s0)))
        split = False                                                         # 6
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                split = True
            acts.append(b(s1, split))
            if i == (r + 1) // 2 and r % 2 == 0:
                split = True
            acts.append(b(s0, split))
        for _ in range(p - r - 1):                                            # 7
            w()
            acts.append(b(s0, split))
        for _ in range(r + 1):                                                # 8
            w()
        ranks.append(acts)
    return Schedule("dualpipev" if pair else "dualpipev-unpaired", ranks, v_layout(p), m, meta={"pair": pair}).check()


def _listed(x) -> list[Action]:
    return x if isinstance(x, list) else [x]


# ------------------------------------------------------------------------------------------------
# Which forwards to checkpoint, and where their recompute goes (a schedule transformation)
# ------------------------------------------------------------------------------------------------
RECOMPUTE_MODES = ("none", "inline", "bubble")
RECOMPUTE_POLICIES = ("cap", "cooldown")


def _held_peak(order: list[Action], checkpointed: set[Key]) -> int:
    """Most stage-chunks of activations a rank holds at once, walking its order, when the forwards of
    ``checkpointed`` keep nothing and rebuild their activations right before their backward."""
    held = peak = 0
    for a in order:
        key = (a.stage, a.mb, a.chunk)
        held += 1 if (a.op == "F" and key not in checkpointed) or (a.op == "B" and key in checkpointed) else 0
        peak = max(peak, held)
        held -= 1 if a.op == "B" else 0
    return peak


def cap_policy(order: list[Action], keep: int) -> set[Key]:
    """Checkpoint as few forwards as the cap needs: walking the rank's order, a forward keeps its
    activations unless that would break ``keep`` even if every later forward were checkpointed."""
    mine: set[Key] = set()
    undecided = {(a.stage, a.mb, a.chunk) for a in order if a.op == "F"}
    for a in order:
        if a.op == "F":
            key = (a.stage, a.mb, a.chunk)
            undecided.discard(key)
            if _held_peak(order, mine | undecided) > keep:
                mine.add(key)
    return mine


def cooldown_policy(order: list[Action]) -> set[Key]:
    """Bubble-aware: checkpoint exactly the forwards whose backward the rank runs in its cool-down (the backwards
    after the one paired with its last forward), where it waits for each gradient to come back down the pipeline. Their recompute then fits
    in that wait instead of delaying anything. Under interleaved stages these include early warm-up chunks
    (long-lived: their backward comes last), so the peak drops too; under plain 1F1B the peak is reached
    before the cool-down and stays."""
    last_f = max(i for i, a in enumerate(order) if a.op == "F")
    tail = [a for a in order[last_f + 1:] if a.op == "B"][1:]  # the first pairs with the last forward (steady)
    return {(a.stage, a.mb, a.chunk) for a in tail}


def with_recompute(schedule: Schedule, mode: str, policy: str = "cap", keep: int | None = None) -> Schedule:
    """``schedule`` with some forwards checkpointed and their activations rebuilt before their backward.

    ``mode``: ``"none"`` (unchanged), ``"inline"`` (the backward recomputes after its gradient arrived,
    ``torch.utils.checkpoint``) or ``"bubble"`` (an R action right before the backward: it needs no gradient,
    so it runs while the rank waits for one). ``policy``: which forwards, per rank: ``"cap"`` (``cap_policy``:
    at most ``keep`` stage-chunks held, default ceil(p/2) micro-batches' worth) or ``"cooldown"``
    (``cooldown_policy``; takes no ``keep``). Works on schedules of single F and B actions (GPipe, 1F1B,
    interleaved 1F1B).
    """
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute={mode!r}; allowed: {RECOMPUTE_MODES}")
    if policy not in RECOMPUTE_POLICIES:
        raise ValueError(f"policy={policy!r}; allowed: {RECOMPUTE_POLICIES}")
    if policy == "cooldown" and keep is not None:
        raise ValueError(f"policy='cooldown' picks the forwards from the schedule and takes no keep (got keep={keep})")
    ops = {part.op for acts in schedule.ranks for a in acts for part in a.parts}
    if not ops <= {"F", "B"} or schedule.checkpointed:
        raise ValueError(f"{schedule.name}: recompute needs a schedule of F and B actions only, without "
                         f"checkpointing yet (it has {sorted(ops)})")
    if policy == "cap":
        keep = -(-schedule.p // 2) * schedule.stages_per_rank * schedule.k if keep is None else keep
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    if mode == "none":
        return schedule
    ranks, ckpt = [], set()
    for order in schedule.ranks:
        mine = cap_policy(order, keep) if policy == "cap" else cooldown_policy(order)
        ckpt |= mine
        if mode == "bubble":
            order = [x for a in order for x in
                     ([Action("R", a.stage, a.mb, a.chunk), a] if a.op == "B" and (a.stage, a.mb, a.chunk) in mine
                      else [a])]
        ranks.append(list(order))
    name = f"{schedule.name}-recompute-{mode}" + ("-cooldown" if policy == "cooldown" else "")
    return replace(schedule, name=name, ranks=ranks, checkpointed=frozenset(ckpt),
                   meta={**schedule.meta, "recompute": mode, "policy": policy, "keep": keep}).check()


# ------------------------------------------------------------------------------------------------
# torch.distributed.pipelining's orders, in this model
# ------------------------------------------------------------------------------------------------
TORCH_NAMES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "zbv": "ZBVZeroBubble",
               "dualpipev": "DualPipeV"}


def torch_order_missing(name: str) -> str | None:
    """Why ``torch_order(name, ...)`` cannot run on this torch (a sentence naming the release it needs), or
    None when it can (torch >= 2.8; DualPipeV >= 2.9)."""
    from toolkit.runtime import compat
    torch_name = TORCH_NAMES.get(name, name)
    return compat.missing("schedule_ops") or (compat.missing("dualpipev") if torch_name == "DualPipeV" else None)


def torch_order(name: str, p: int, m: int) -> Schedule:
    """torch.distributed.pipelining's compute order for ``name`` (a key or value of ``TORCH_NAMES``) as a
    ``Schedule``, *not* checked (``from_torch`` is the checked one; ``compare_orders`` uses this).

    torch's ``FULL_BACKWARD`` is B, ``BACKWARD_INPUT`` I, ``OVERLAP_F_B`` FB; communication and
    ``REDUCE_GRAD`` entries are dropped. Multi-stage schedules get 2 stages per rank.
    """
    torch_name = TORCH_NAMES.get(name, name)
    if torch_name not in TORCH_NAMES.values():
        raise ValueError(f"schedule={name!r} has no torch counterpart here; allowed: {sorted(TORCH_NAMES)}")
    from toolkit.runtime import compat
    compat.require("schedule_ops")
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    single = issubclass(compat.pipeline_schedule_class(torch_name), PipelineScheduleSingle)
    ops = get_schedule_ops(torch_name, p, m, num_stages_per_rank=1 if single else 2)
    kinds = {"F": "F", "B": "B", "I": "I", "W": "W"}

    def convert(a) -> Action | None:
        if a is None:
            return None
        if getattr(a, "sub_actions", None):  # an overlapped F&B pair (torch 2.8.0's actions have no such field)
            return fb(*(convert(s) for s in a.sub_actions))
        op = kinds.get(a.computation_type.value)
        return Action(op, a.stage_index, a.microbatch_index) if op else None

    ranks = [[c for c in map(convert, row) if c is not None] for row in ops]
    layout = linear_layout(p) if single else (v_layout(p) if torch_name in ("ZBVZeroBubble", "DualPipeV")
                                              else interleaved_layout(p, 2))
    key = next(k for k, v in TORCH_NAMES.items() if v == torch_name)
    return Schedule(f"torch-{torch_name}", ranks, layout, m, meta={"torch_name": key})


def from_torch(name: str, p: int, m: int) -> Schedule:
    """The compute order torch.distributed.pipelining defines for ``name`` (a key or value of
    ``TORCH_NAMES``), converted to this model (no processes needed) and checked like every generator's.

    torch's ``FULL_BACKWARD`` is B, ``BACKWARD_INPUT`` I, ``OVERLAP_F_B`` FB; communication and
    ``REDUCE_GRAD`` entries are dropped. Multi-stage schedules get 2 stages per rank. Raises ValueError when
    torch's order is not a complete schedule (torch 2.13's 1F1B display order numbers the last rank's
    micro-batches from 1: ``torch_order`` gives it unchecked, for comparisons).
    """
    return torch_order(name, p, m).check()


# ------------------------------------------------------------------------------------------------
# By name
# ------------------------------------------------------------------------------------------------
SCHEDULES = {
    "gpipe": lambda p, m: gpipe(p, m),
    "1f1b": lambda p, m: one_f_one_b(p, m),
    "interleaved": lambda p, m, v=2: interleaved_1f1b(p, m, v),
    "zb-h1": lambda p, m: zb_h1(p, m),
    "dualpipev": lambda p, m, pair=True: dualpipev(p, m, pair),
    "1f1b-recompute-inline": lambda p, m, keep=None, policy="cap": one_f_one_b(p, m, "inline", keep, policy),
    "1f1b-recompute-bubble": lambda p, m, keep=None, policy="cap": one_f_one_b(p, m, "bubble", keep, policy),
    "interleaved-recompute-inline": lambda p, m, v=2, keep=None, policy="cap": interleaved_1f1b(p, m, v, "inline",
                                                                                                keep, policy),
    "interleaved-recompute-bubble": lambda p, m, v=2, keep=None, policy="cap": interleaved_1f1b(p, m, v, "bubble",
                                                                                                keep, policy),
}
"""name -> builder(p, m, **options); a builder's keyword parameters are the options the name accepts."""


@dataclass(frozen=True)
class Needs:
    """What a named schedule needs of its layout, said once here and asked by everyone else (the planner, ``compose``,
    the lessons): how many stages each rank holds and how few micro-batches it can run, both from p and the
    schedule's options (``v``)."""

    stages_per_rank: int | str = 1
    """Stages (model chunks) each of the p ranks holds: a number, or the name of the option that gives it."""
    min_m: int = 1
    """The fewest micro-batches, as a multiple of p (the planner and ``compose`` hold a layout to it)."""
    why: str = "one micro-batch in flight per stage"
    """Why ``min_m`` (the error says it)."""

    def stages(self, p: int, **options) -> int:
        per = self.stages_per_rank
        return p * (per if isinstance(per, int) else int(options.get(per, 2)))


NEEDS: dict[str, Needs] = {
    "gpipe": Needs(), "1f1b": Needs(), "interleaved": Needs("v"), "zb-h1": Needs(),
    "dualpipev": Needs(2, 2, "both ends of the V feed micro-batches"),
    "1f1b-recompute-inline": Needs(), "1f1b-recompute-bubble": Needs(),
    "interleaved-recompute-inline": Needs("v"), "interleaved-recompute-bubble": Needs("v"),
}
"""name -> its ``Needs``; ``register`` adds a schedule with both."""


def register(name: str, builder, needs: Needs | None = None) -> None:
    """Add a schedule by name: ``builder(p, m, **options) -> Schedule`` and what it needs of its layout. After this,
    ``make_schedule``, the planner (``choose(schedules=...)``), ``compose`` and the simulator accept it."""
    if not callable(builder):
        raise ValueError(f"register({name!r}): builder must be callable(p, m, **options), got {builder!r}")
    SCHEDULES[name], NEEDS[name] = builder, needs or Needs()


def needs(name: str) -> Needs:
    """What schedule ``name`` needs of its layout (``Needs``)."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not known; allowed: {sorted(SCHEDULES)}")
    return NEEDS.get(name, Needs())


def check_layout(name: str, p: int, m: int, n_layer: int | None = None, p_name: str = "pp", **options) -> int:
    """ValueError naming the parameter when schedule ``name`` cannot run ``m`` micro-batches on ``p`` ranks, or cut
    ``n_layer`` layers into its stages; else the number of stages."""
    need = needs(name)
    low = need.min_m * p
    if m < low:
        rule = p_name if need.min_m == 1 else f"{need.min_m} × {p_name}"
        raise ValueError(f"m={m} micro-batches is too few: {name} needs m >= {rule} = {low} ({need.why})")
    stages = need.stages(p, **options)
    if n_layer is not None and n_layer % stages:
        per = stages // p
        raise ValueError(f"n_layer={n_layer} must be divisible by the {stages} pipeline stages of {name} on "
                         f"{p_name}={p}" + (f" ({per} per rank)" if per > 1 else ""))
    return stages


def fits(name: str, p: int, m: int, n_layer: int | None = None, **options) -> bool:
    """Whether schedule ``name`` can run this layout (``check_layout`` without the error)."""
    try:
        check_layout(name, p, m, n_layer, **options)
    except ValueError:
        return False
    return True


def schedule_options(name: str) -> tuple[str, ...]:
    """The options ``make_schedule(name, p, m, ...)`` accepts (read off the builder's signature)."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r} is not known; allowed: {sorted(SCHEDULES)}")
    return tuple(inspect.signature(SCHEDULES[name]).parameters)[2:]


def make_schedule(name: str, p: int, m: int, **options) -> Schedule:
    """``make_schedule("dualpipev", p=2, m=8)``: the named schedule, checked.

    Options by name (``schedule_options``): ``v`` (interleaved*: stages per rank), ``keep`` (*-recompute-*:
    stage-chunks a rank may hold), ``policy`` (*-recompute-*: ``"cap"`` or ``"cooldown"``), ``pair`` (dualpipev:
    False runs each F&B as a separate F and B). An option
    the schedule does not take is a ValueError naming the ones it does.
    """
    allowed = schedule_options(name)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"schedule {name!r} takes no option {', '.join(unknown)}; its options: "
                         f"{list(allowed) if allowed else 'none'}")
    return SCHEDULES[name](p, m, **options)
