"""``moe.device_fetch``: a batch-1 decode step of a quantized, offloaded MoE layer with no host decision in it.

The default decode path (:mod:`ds_maximus.experts.offload`) brings each layer's routing to the host (one sync a
layer), decides there which experts to load and guess, and queues the copies and the expert GEMMs. While the host
decides, the GPU has nothing queued; on a host that is slow next to its GPU that wait, not the link, sets the speed
of a batch-1 decode (``docs/bench/moe_offload.md``). With ``device_fetch`` a batch-1 decode step never waits for the
GPU; per layer:

1. ``fetch_experts`` (one Triton kernel, :mod:`ds_maximus.experts.quant_triton`) looks each routed expert up in the
   layer's slot table *on the GPU*: an expert in a slot is read there; one that is not is copied by the same kernel
   from the page-locked CPU tier, which it reads over the link through its mapped address, into a staging buffer of
   the step (one per routed expert). It writes where the GEMMs find each expert.
2. The two projections run as the default path's one-row gemv over those places, then the gate, the routing
   weights and the sum: the same ops on the same numbers as :func:`ds_maximus.experts.compute.packed_forward`
   (experts added in ascending id), so the tokens and logits are the default path's, bit for bit.

With ``moe.speculative_prefetch`` (the default) each step also guesses the next layer's experts on the GPU (that
layer's router on this layer's input, its best ``prefetch_top_k``; with ``prefetch_skip_resident`` the best not in a
slot) and fetches the guesses not in a slot on a side stream, into staging buffers of their own, while this layer
computes; the next layer reads a right guess from there and waits for the guesses' copy before its own fetch. A
wrong guess costs its bytes on the link. A fetched expert goes to a staging buffer, not a slot: the slots keep what
the previous multi-token forward (the prefill) left in them, and every other expert crosses the link each time it
is routed to, until a refresh (``moe.device_fetch_refresh_tokens``, :meth:`DeviceFetch.rebalance`) loads the
experts routed to most in place of the resident ones routed to least. The host learns a step's routing only
afterwards (the ids are copied back without waiting, and counted at a refresh, when the stats are read or when the
next multi-token forward starts): a fetched expert is a miss and its bytes are ``bytes_h2d``. A forward of several
tokens (a prefill, a batch's decode step) takes the default path, whose loads and evictions then refresh the slot
tables. Needs packed (``moe.quant``, whole-byte codes) experts in the pinned CPU tier; CUDA runs the kernels, other
devices run the same steps with plain copies and :func:`ds_maximus.experts.quant.linear` (the reference the tests
compare against).

    >>> # used by MoEOffload._forward; see tests/experts/test_device_fetch.py
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ds_maximus.errors import ConfigError
from ds_maximus.experts import quant
from ds_maximus.experts.quant_layout import QuantizedExpertLayout
from ds_maximus.experts.quant_triton import decode_config, fetch_experts, gemv_fits, quant_matmul_grouped
from ds_maximus.ops import to_device

# routed-expert records (one row of top_k ids a layer step) kept before the host waits to count them
LOG_ROWS = 4096
# residency: an expert routed n times (decayed) takes the slot of a resident one routed r times when n - r is at
# least SWAP_MIN and SWAP_Z standard deviations of a Poisson difference (sqrt(n + r)): under uniform routing the
# counts differ by noise, and a swap would only cost its copy
SWAP_Z = 3.0
SWAP_MIN = 2.0
SWAPS_PER_LAYER = 2  # at most this many a layer a refresh: a swap's copy shares the link with the step's fetches
DECAY = 0.5          # the counts' weight after each refresh (recent steps count more)


class DeviceFetch:
    """The device-fetch decode step of every MoE layer of one offloaded model (see the module docstring).
    ``guesses``: staging buffers for a layer's guesses of the next one (0: no guesses). ``kernels``: run the Triton
    kernels (default: on CUDA; the tests run them on the host under Triton's interpreter, in one stream).
    ``refresh``: every this many device-fetched tokens, the slots take the experts routed to most since (0: never;
    see :meth:`rebalance`)."""

    def __init__(self, cache, top_k: int, guesses: int = 0, kernels: Optional[bool] = None, refresh: int = 0):
        lay = cache.layout
        if not isinstance(lay, QuantizedExpertLayout):
            raise ConfigError("moe.device_fetch needs quantized experts: set moe.quant (8, 4 or 2 bits)",
                              "maximus.moe.device_fetch")
        if not gemv_fits(lay.bits, lay.group_size):
            raise ConfigError(f"moe.device_fetch reads experts with the one-row gemv, which takes 8-, 4- or 2-bit "
                              f"codes in power-of-two groups of at least 16; got {lay.bits} bits, group "
                              f"{lay.group_size}", "maximus.moe.device_fetch")
        store = cache.store
        if store.tier != "cpu":
            raise ConfigError("moe.device_fetch reads missed experts from the CPU tier; the experts are on "
                              f"{store.tier} (set moe.offload.device to 'cpu')", "maximus.moe.device_fetch")
        self.cuda = cache.device.type == "cuda"
        self.kernels = self.cuda if kernels is None else bool(kernels)
        if self.cuda and not getattr(store, "pinned", False):
            raise ConfigError("moe.device_fetch reads missed experts through their mapped address, which needs the "
                              "CPU tier page-locked (moe.offload.pin_memory true)", "maximus.moe.device_fetch")
        self.cache = cache
        self.numel = lay.numel
        self.top_k = int(top_k)
        self.num_experts = cache.num_experts
        # without the kernels a step fetches in order: nothing to overlap
        self.guesses = min(int(guesses), self.num_experts) if self.kernels else 0
        # rows [0, top_k): a step's missed experts; then two sets of ``guesses`` rows, by the guessed layer's parity
        self.buffers = torch.empty((self.top_k + 2 * self.guesses, self.numel), dtype=torch.uint8,
                                   device=cache.device)
        self.stage = self.buffers[:self.top_k]
        E, G = self.num_experts, cache.num_groups
        # each expert's place in the CPU tier as int32 words from the buffers' address (the kernel's view)
        host: List[List[int]] = []
        for gi in range(G):
            row = []
            for e in range(E):
                gap = store.host_view(gi * E + e).data_ptr() - self.buffers.data_ptr()
                if gap % 16:
                    raise ConfigError("moe.device_fetch needs each expert of the CPU tier 16-byte aligned",
                                      "maximus.moe.device_fetch")
                row.append(gap // 4)
            host.append(row)
        self.host_off = [self._device(r) for r in host]
        self.slot_off: List[Optional[torch.Tensor]] = [None] * G  # the layer's slot table, built when first needed
        self.resident: List[frozenset] = [frozenset()] * G
        self.dirty = set(range(G))
        self.meta: Dict[int, torch.Tensor] = {}  # by top_k: starts 0..K, then the K offsets the kernel writes
        self.active = False  # a device-fetched step ran since the last multi-token forward
        if self.guesses:
            self.side = torch.cuda.Stream(cache.device) if self.cuda else None
            self.guess_meta = [self._device(list(range(self.guesses + 1)) + [0] * self.guesses) for _ in range(2)]
        self.guessed: List[Optional[Tuple[int, torch.Tensor, object]]] = [None, None]  # (layer, ids, event)
        width = self.top_k + max(1, self.guesses)
        self.log = torch.full((LOG_ROWS, width), -1, dtype=torch.long, pin_memory=self.cuda)
        # (layer, routed, guesses, the layer's residents then)
        self.pending: List[Tuple[int, int, int, frozenset]] = []
        self.log_event = None
        self.fetches = 0
        self.refresh = int(refresh)
        self.routed = [[0.0] * E for _ in range(G)]  # each layer's decayed routing counts (device-fetched steps)
        self.tokens = 0  # device-fetched tokens since the last refresh
        self.swaps = 0

    def _device(self, values: List[int]) -> torch.Tensor:
        return to_device(torch.tensor(values, dtype=torch.long), self.cache.device)

    # -- the slot tables -------------------------------------------------------------------------
    def _refresh(self, group: int) -> None:
        """The layer's slot table from the cache's map: an expert whose load has landed (or that the compute
        stream already waits for) is read from its slot; a guess still in flight is left out until it lands."""
        c = self.cache
        g = c.groups[group]
        c._reap(g)
        vals = [-1] * self.num_experts
        for s, e in enumerate(g.map.slot_to_id.tolist()):
            if e >= 0 and s not in g.inflight:
                vals[e] = s * self.numel
        self.slot_off[group] = self._device(vals)
        self.resident[group] = frozenset(e for e in range(self.num_experts) if vals[e] >= 0)
        if not g.inflight:
            self.dirty.discard(group)

    def _table(self, group: int) -> torch.Tensor:
        if group in self.dirty or self.slot_off[group] is None:
            self._refresh(group)
        return self.slot_off[group]

    def leave(self) -> None:
        """Before a multi-token forward (the default path): count the logged steps, order the slots' next loads
        after the device-fetched steps that read them, and rebuild the tables when next needed."""
        if not self.active:
            return
        if self.guesses and self.cuda:  # unused guesses: their copies end before anything reuses the buffers
            torch.cuda.current_stream(self.cache.device).wait_stream(self.side)
        self.guessed = [None, None]
        self.flush()
        ev = self.cache.transfer.record_use()  # every slot was readable by the steps queued so far
        for g in self.cache.groups:
            g.use_ev = [ev] * len(g.use_ev)
        self.dirty = set(range(self.cache.num_groups))
        self.active = False

    # -- counting ---------------------------------------------------------------------------------
    def flush(self) -> None:
        """Count the logged steps' routing and guesses (waits for their copies to land)."""
        if not self.pending:
            return
        if self.log_event is not None:
            self.log_event.synchronize()
        c, t = self.cache.counters, self.cache.traffic
        rows = self.log[:len(self.pending)].tolist()
        for (group, k, p, have), row in zip(self.pending, rows):
            ids, guessed = row[:k], [e for e in row[k:k + p] if e not in have]  # only those not in a slot cross
            staged = 0
            routed = self.routed[group]
            for e in ids:
                routed[e] += 1
                if e in have:
                    c.hits += 1
                elif e in guessed:
                    c.hits += 1
                    t.prefetch_used += 1
                    staged += 1
                else:
                    c.misses += 1
                    t.rows_fetched += 1
                    t.bytes_h2d += self.numel
                    self.fetches += 1
            c.lookups += k
            t.prefetch_issued += len(guessed)
            t.prefetch_cancelled += len(guessed) - staged
            t.rows_fetched += len(guessed)
            t.bytes_prefetch += len(guessed) * self.numel
            t.bytes_h2d += len(guessed) * self.numel
        self.pending = []
        self.log_event = None

    def rebalance(self) -> bool:
        """Between two tokens: in each layer, load into a slot the experts the device-fetched steps routed to most
        since the last refresh (decayed counts), in place of the resident ones routed to least, where the
        difference is more than noise (``SWAP_Z``, ``SWAP_MIN``; at most ``SWAPS_PER_LAYER`` a layer). Without
        it the slots keep what the prefill left while the routing drifts. A load waits for the steps queued so
        far (they may read the slot it overwrites) and runs on the transfer stream; the slot table leaves the
        slot out until the load lands. Returns False, doing nothing, while the logged routing is still in flight
        (the host never waits for the GPU here)."""
        if self.log_event is not None and not self.log_event.query():
            return False
        self.flush()
        c = self.cache
        after = None
        for gi, g in enumerate(c.groups):
            c._reap(g)
            counts = self.routed[gi]
            slot_ids = g.map.slot_to_id.tolist()
            busy = {slot_ids[s] for s in g.inflight}
            here = [e for e in slot_ids if e >= 0 and e not in busy]
            free = [None] * slot_ids.count(-1)
            have = set(slot_ids)
            victims = free + sorted(here, key=lambda e: counts[e])  # least routed first
            wanted = sorted((e for e in range(self.num_experts) if e not in have), key=lambda e: -counts[e])
            for new, old in list(zip(wanted, victims))[:SWAPS_PER_LAYER]:
                n, r = counts[new], 0.0 if old is None else counts[old]
                if n - r < SWAP_MIN or n - r <= SWAP_Z * math.sqrt(n + r):
                    break
                if after is None:
                    after = c.transfer.record_use()  # the steps queued so far are the slots' last readers
                if c.replace(gi, new, old, after):
                    self.swaps += 1
                    self.dirty.add(gi)
            self.routed[gi] = [x * DECAY for x in counts]
        return True

    def _record(self, group: int, ids: torch.Tensor, guess: Optional[torch.Tensor]) -> None:
        if len(self.pending) == LOG_ROWS:
            self.flush()
        row = len(self.pending)
        k, p = ids.numel(), 0 if guess is None else guess.numel()
        self.log[row, :k].copy_(ids, non_blocking=self.cuda)
        if p:
            self.log[row, k:k + p].copy_(guess, non_blocking=True)
        self.pending.append((group, k, p, self.resident[group]))
        if self.cuda:
            if self.log_event is None:
                self.log_event = torch.cuda.Event()
            self.log_event.record()

    # -- the step ---------------------------------------------------------------------------------
    def forward(self, group: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                apply_gate: Callable[[torch.Tensor], torch.Tensor],
                predict: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                skip_resident: bool = False) -> torch.Tensor:
        """One token's (``hidden`` [1, H]) output of layer ``group``: its routed experts in ascending id.
        ``predict``: the next layer's router logits of ``hidden`` (its guesses are fetched while this layer
        computes), or None after the last layer or without guesses."""
        if group == 0 and self.refresh:  # a token starts: no guess is in flight for any layer
            self.tokens += 1
            if self.tokens > self.refresh and self.rebalance():
                self.tokens = 0
        table_off = self._table(group)
        self.active = True
        ids, w = top_k_index.reshape(-1), top_k_weights.reshape(-1)
        K = ids.numel()
        if K > 2:  # the experts' outputs are added in ascending id (two adds commute: no sort needed)
            ids, order = torch.sort(ids)
            w = w[order]
        ids = ids.contiguous()
        lay = self.cache.layout
        table = self.cache.slot_buffer(group)
        guess = None
        if self.kernels:
            meta = self.meta.get(K)
            if meta is None:
                meta = self.meta[K] = self._device(list(range(K + 1)) + [0] * K)
            par = group % 2
            place = None
            if self.guessed[par] is not None and self.guessed[par][0] == group:  # guesses fetched for this layer
                _, guess, ev = self.guessed[par]
                if ev is not None:
                    torch.cuda.current_stream(hidden.device).wait_event(ev)
                place = self.guess_meta[par][guess.numel() + 1:]
                self.guessed[par] = None
            fetch_experts(self.stage[:K], ids, table_off, self.host_off[group], meta,
                          self.stage.data_ptr() - table.data_ptr(), pred=guess, pred_place=place)
            if predict is not None and self.guesses:
                self._guess(group + 1, hidden, predict, skip_resident)

            def linear(x, name):
                return quant_matmul_grouped(x, table, lay.parts[name], lay.base.shapes[name], lay.bits,
                                            lay.group_size, meta, K, 1, config=decode_config(lay.bits)).to(x.dtype)
        else:
            flats = self._places(group, ids.tolist(), table)

            def linear(x, name):
                return torch.cat([quant.linear(x[i:i + 1], lay.view(f, name)) for i, f in enumerate(flats)]
                                 ).to(x.dtype)
        self._record(group, ids, guess)
        h = linear(hidden.expand(K, -1), "gate_up_proj")
        h = linear(apply_gate(h), "down_proj")
        h = (h * w[:, None]).to(hidden.dtype)
        out = h[0:1]
        for r in range(1, K):
            out = out + h[r:r + 1]
        return out

    def _guess(self, nxt: int, hidden: torch.Tensor, predict, skip_resident: bool) -> None:
        """Layer ``nxt``'s guesses from this layer's input, fetched on the side stream into their own buffers."""
        table_off = self._table(nxt)
        logits = predict(hidden).reshape(-1)
        if skip_resident:  # the best predicted experts not already in a slot
            logits = logits.masked_fill(table_off >= 0, float("-inf"))
        P = self.guesses
        guess = torch.topk(logits, P).indices
        par = nxt % 2
        rows = self.buffers[self.top_k + par * self.guesses:self.top_k + par * self.guesses + P]

        def fetch():
            fetch_experts(rows, guess, table_off, self.host_off[nxt], self.guess_meta[par],
                          rows.data_ptr() - self.cache.slot_buffer(nxt).data_ptr(),
                          host_shift=-(self.top_k + par * self.guesses) * (self.numel // 4))

        if not self.cuda:  # one stream: in order
            fetch()
            self.guessed[par] = (nxt, guess, None)
            return
        ev = torch.cuda.Event()
        ev.record()  # the guess and every earlier reader of these buffers (the layer two back) are queued before
        self.side.wait_event(ev)
        with torch.cuda.stream(self.side):
            fetch()
            done = torch.cuda.Event()
            done.record()
        for t in (guess, table_off):
            t.record_stream(self.side)
        self.guessed[par] = (nxt, guess, done)

    def _places(self, group: int, ids: List[int], table: torch.Tensor) -> List[torch.Tensor]:
        """Off CUDA: the kernel's lookup and copies on the host (the same tables, plain copies)."""
        offs = self.slot_off[group].tolist()
        store = self.cache.store
        out = []
        for k, e in enumerate(ids):
            if offs[e] >= 0:
                out.append(table[offs[e] // self.numel])
            else:
                self.stage[k].copy_(store.host_view(group * self.num_experts + e))
                out.append(self.stage[k])
        return out

    def stats(self) -> dict:
        """The mode's own entries (the caller flushes first, so the cache's counters include the logged steps)."""
        return {"device_fetch": True, "device_fetches": self.fetches, "device_fetch_swaps": self.swaps,
                "device_fetch_staging_bytes": self.buffers.numel()}

    def reset_stats(self) -> None:
        self.flush()
        self.fetches = self.swaps = 0

    def close(self) -> None:
        """Wait for the guesses in flight (they read the CPU tier, which closing the store frees)."""
        if self.guesses and self.cuda:
            self.side.synchronize()
        self.flush()
