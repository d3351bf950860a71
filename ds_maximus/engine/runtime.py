"""``MaximusRuntime``: hooks a DeepSpeed engine so its backward/step/checkpoint also drive the
sharded modules' sparse update.

* ``engine.backward``: records whether this micro-batch ends a gradient-accumulation window.
* the carrier (see ``norm_carrier.py``): at the window's last backward, sparse grads are combined
  across data-parallel ranks and their norm joins DeepSpeed's global norm.
* ``engine.step``: at the boundary, DeepSpeed steps first; if it skipped (fp16 overflow, sparse
  included) the sparse grads are dropped; otherwise they are unscaled, clipped with the same global
  norm and coefficient DeepSpeed used, and the sparse optimizer runs with the engine's current lr.
* ``engine.save_checkpoint`` / ``load_checkpoint``: also save/restore every module's maximus state.
"""
from __future__ import annotations

import logging
import math
import os
import time
from typing import Dict, List, Optional

import torch

from ds_maximus.config import MaximusConfig, ShardMode
from ds_maximus.engine.checkpoint_space import (
    check_free_space,
    disk_full_reported,
    engine_bytes,
    remove_quietly,
    state_bytes,
)
from ds_maximus.engine.protocol import MaximusModule, ModuleRole
from ds_maximus.errors import DistributedError, ShardStoreError

logger = logging.getLogger("ds_maximus")
STATE_FILE = "maximus_states.pt"


def _atomic_torch_save(obj, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        remove_quietly(tmp)  # a failed write (disk full) leaves no partial file behind
        raise


class MaximusRuntime:
    """Owns the engine hooks. ``engine.maximus`` points at it. Every module it drives is a
    :class:`~ds_maximus.engine.protocol.MaximusModule`, reached through that class's methods only."""

    def __init__(self, engine, modules: Dict[str, MaximusModule], cfg: MaximusConfig):
        wrong = {n: type(m).__name__ for n, m in modules.items() if not isinstance(m, MaximusModule)}
        if wrong:
            raise TypeError(f"MaximusRuntime drives MaximusModule subclasses only; {wrong} are not "
                            "(subclass ds_maximus.engine.protocol.MaximusModule and implement its abstract methods)")
        self.engine = engine
        self.modules = modules
        self.cfg = cfg
        self._boundary = True
        self._carrier_sent = 0.0
        self.steps = 0
        self.skipped_steps = 0
        self.last_clip_coef = 1.0
        self.last_step_ms = 0.0
        self._orig = {}

    # -- install ------------------------------------------------------------------------------
    def install(self) -> None:
        e = self.engine
        for name in ("backward", "step", "save_checkpoint", "load_checkpoint"):
            self._orig[name] = getattr(e, name)
        e.backward = self._backward
        e.step = self._step
        e.save_checkpoint = self._save_checkpoint
        e.load_checkpoint = self._load_checkpoint
        e.maximus = self
        self._defer_head_steps()
        # DeepSpeed casts parameters (not modules) to bf16/fp16: tell the sharded modules their output dtype
        dtype = torch.bfloat16 if e.bfloat16_enabled() else torch.float16 if e.fp16_enabled() else None
        if dtype is not None:
            for m in self.modules.values():
                m.set_out_dtype(dtype)
        self._match_initial_steps()

    def _match_initial_steps(self) -> None:
        """DeepSpeed's ZeRO-0 fp16/bf16 optimizer wrappers (``FP16_Optimizer``, ``FP16_UnfusedOptimizer``) take one
        optimizer step with zero gradients when they are built, so a dense parameter's first real AdamW step is its
        second: bias correction one step on (the first update is 0.73 lr, not lr, at betas 0.9/0.95) after one
        weight decay at the configured lr. The sharded rows take the same step here, touching no row (exact mode
        applies its decay as it replays a row's skipped steps), and so does a CPU-placed head's tier, so they train as
        the dense tables would have under plain DeepSpeed. Lazy mode (``torch.optim.SparseAdam``'s semantics) does
        not."""
        opt = getattr(self.engine, "basic_optimizer", None)
        state = getattr(opt, "state", None)
        first = next(iter(state.values()), None) if isinstance(state, dict) and state else None
        steps = int(first.get("step", 0)) if isinstance(first, dict) else 0
        if steps <= 0:
            return
        group = self._param_group()
        lr = group.get("initial_lr", getattr(opt, "defaults", {}).get("lr", group.get("lr")))
        wd = group.get("weight_decay")
        for m in self.modules.values():
            m.take_zero_grad_steps(steps, lr, wd)

    def of_role(self, role: ModuleRole) -> List[MaximusModule]:
        """The driven modules of ``role``, in the order they were handed over."""
        return [m for m in self.modules.values() if m.role is role]

    def _defer_head_steps(self) -> None:
        """With a sharded embedding beside a head whose step streams its state through the GPU, the head's
        step copies start at the embedding's next forward instead of at ``engine.step()`` (see
        :meth:`~ds_maximus.engine.protocol.MaximusModule.defer_step_to`; docs/bench/headline_profile.md)."""
        embs = self.of_role(ModuleRole.ROWS)
        if not embs:
            return
        for head in self.of_role(ModuleRole.HEAD):
            head.defer_step_to(embs[0])

    # -- groups / scalars ---------------------------------------------------------------------
    def _dp_group(self):
        try:
            from deepspeed.utils import groups
            return groups._get_data_parallel_group()
        except Exception:
            return None

    def _loss_scale(self) -> float:
        if not self.engine.fp16_enabled():
            return 1.0
        opt = self.engine.optimizer
        for attr in ("cur_scale", "loss_scale"):
            v = getattr(opt, attr, None)
            if v is not None:
                return float(v)
        return 1.0

    def _param_group(self) -> dict:
        opt = getattr(self.engine, "basic_optimizer", None) or self.engine.optimizer
        groups = getattr(opt, "param_groups", None) or [{}]
        return groups[0]

    # -- the carrier's callback ----------------------------------------------------------------
    def on_sparse_backward_done(self):
        """Called at the end of the sharded modules' backward; returns the carrier increment: the sparse norm's
        growth since the last micro-batch, a float or (where a module's gradient is on a GPU) a device scalar."""
        with torch.profiler.record_function("maximus.sparse_grad_norm"):
            return self._sparse_backward_done()

    def _sparse_backward_done(self):
        owned = [m for m in self.modules.values() if m.owns_partition]  # partitioned: grads at owners
        shared = [m for m in self.modules.values() if not m.owns_partition]
        if self._boundary and shared:
            group = self._dp_group()
            for m in shared:
                m.reduce_grads(group)
        parts = [m.sparse_grad_norm_sq() for m in shared]
        sq = sum(float(p) for p in parts if p.device.type == "cpu")  # host values: no wait
        if owned:
            local = torch.stack([m.sparse_grad_norm_sq().float().cpu() for m in owned]).sum().reshape(1)
            # each rank holds the grads of its own rows: the global norm sums every rank's share
            sq += float(owned[0].reduce_norm_sq(local)) if self._boundary else float(local)
        on_device = [p for p in parts if p.device.type != "cpu"]
        if on_device:
            # the norm stays a device scalar: reading it here would make the host wait for the whole backward, and
            # DeepSpeed's step (host-bound at LoRA's hundreds of small parameters) would no longer overlap its end
            dev = on_device[0].device
            norm = (torch.stack([p.to(dev, torch.float64) for p in on_device]).sum() + sq).sqrt()
        else:
            norm = math.sqrt(sq) if math.isfinite(sq) else sq
        inc = norm - self._carrier_sent
        self._carrier_sent = norm
        return inc

    # -- hooks ---------------------------------------------------------------------------------
    def _backward(self, loss, *args, **kwargs):
        self._boundary = self.engine.is_gradient_accumulation_boundary()
        return self._orig["backward"](loss, *args, **kwargs)

    def _dense_norm_stage0_fp32(self) -> Optional[float]:
        e = self.engine
        if e.fp16_enabled() or e.bfloat16_enabled() or e.zero_optimization():
            return None
        # each gradient's square sum in fp32 on the engine's device, read back in one copy (not one host wait a
        # tensor), then added in double in the parameters' order
        parts = [p.grad.detach().float().pow(2).sum() for p in e.module.parameters() if p.grad is not None]
        sq = 0.0
        for v in (torch.stack(parts).tolist() if parts else ()):
            sq += v
        return math.sqrt(sq)

    def _step(self, lr_kwargs=None):
        e = self.engine
        if not e.is_gradient_accumulation_boundary():
            return self._orig["step"](lr_kwargs)
        lr = float(e.get_lr()[0]) if e.get_lr() else None
        group = self._param_group()
        wd = group.get("weight_decay")
        scale = self._loss_scale()
        stage0_norm = self._dense_norm_stage0_fp32() if e.gradient_clipping() > 0 else None
        with torch.profiler.record_function("maximus.deepspeed_step"):  # a range in the user's profiler traces
            out = self._orig["step"](lr_kwargs)
        t0 = time.perf_counter()
        if not e.was_step_applied():
            for m in self.modules.values():
                m.zero_sparse_grads()
            self.skipped_steps += 1
        else:
            total = stage0_norm if stage0_norm is not None else e.get_global_grad_norm()
            coef = 1.0
            clip = e.gradient_clipping()
            if clip > 0 and total is not None and math.isfinite(float(total)):
                coef = min(1.0, clip / (float(total) + 1e-6))
            self.last_clip_coef = coef
            with torch.profiler.record_function("maximus.sparse_step"):
                for m in self.modules.values():
                    if coef / scale != 1.0:
                        m.scale_sparse_grads_(coef / scale)
                    m.sparse_step(lr, wd)
            self.steps += 1
        self._carrier_sent = 0.0
        self.last_step_ms = (time.perf_counter() - t0) * 1e3
        from ds_maximus.observability import log_stats
        log_stats(self)
        return out

    # -- checkpoints ---------------------------------------------------------------------------
    def _state(self) -> dict:
        # the shard mode it was written in: a replicated resume of a broadcast checkpoint is refused by name (the
        # broadcast model file holds no table rows, which DeepSpeed would report as missing keys)
        return {"modules": {n: m.maximus_state_dict() for n, m in self.modules.items()},
                "steps": self.steps, "skipped_steps": self.skipped_steps,
                "shard_mode": self.cfg.distributed.shard_mode.value}

    def _save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, **kwargs):
        e = self.engine
        if tag is None:
            tag = f"global_step{e.global_steps}"
        for m in self.modules.values():
            m.flush()
        folder = os.path.join(save_dir, str(tag))
        mode = self.cfg.distributed.shard_mode
        writer = self.cfg.distributed.master_rank if mode == ShardMode.BROADCAST else 0
        writes = e.global_rank == writer or mode == ShardMode.PARTITIONED
        state = self._state() if writes else None
        own, ds = state_bytes(state), engine_bytes(e)
        need = own + ds
        what = f"model and optimizer {ds / 2**20:.1f} MiB, maximus state {own / 2**20:.1f} MiB"
        try:  # every rank learns whether one is short, so none goes on into DeepSpeed's collectives alone
            check_free_space(save_dir, need, what)
            short = None
        except ShardStoreError as err:
            short = err
        if self._any_rank(short is not None):
            raise short or ShardStoreError(f"another rank has too little disk space for its share of the checkpoint "
                                           f"to {folder}; see its error", folder)
        # the maximus state first: DeepSpeed moves `latest` last, so a failed save never names a partial checkpoint
        with disk_full_reported(folder, need, what):
            if writes:
                os.makedirs(folder, exist_ok=True)
                name = STATE_FILE if mode != ShardMode.PARTITIONED else f"maximus_states_rank{e.global_rank:05d}.pt"
                _atomic_torch_save(state, os.path.join(folder, name))
            del state
            out = self._orig["save_checkpoint"](save_dir, tag=tag, client_state=client_state,
                                                save_latest=save_latest, **kwargs)
        if e.global_rank == 0:  # DeepSpeed's zero_to_fp32.py copy would leave the tables out: ours puts them in
            from ds_maximus.engine.zero_to_fp32 import write_recovery_script
            write_recovery_script(save_dir)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        return out

    def _any_rank(self, flag: bool) -> bool:
        """``flag`` or'ed over every rank (itself where the run has one process)."""
        if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=self.engine.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())

    def _replicated_state(self, folder: str, trust: bool) -> Optional[dict]:
        """The maximus state of ``folder`` read before DeepSpeed's part, for the replicated mode: one written in the
        broadcast mode is refused by name (its model file holds no table rows). None when the file is missing (the
        error for that comes after DeepSpeed's load, as before)."""
        path = os.path.join(folder, STATE_FILE)
        if not os.path.exists(path):
            return None
        from ds_maximus.safe_load import safe_torch_load
        state = safe_torch_load(path, trust=trust)
        if state.get("shard_mode") == ShardMode.BROADCAST.value:
            raise DistributedError(
                f"checkpoint {folder} was saved in the broadcast shard mode: the master's {STATE_FILE} holds the "
                "tables and the model file holds none of their rows, which the replicated mode reads from the model "
                "file. fix: resume it with maximus.distributed.shard_mode 'broadcast' or 'partitioned' (on any "
                "number of ranks)")
        return state

    def _load_checkpoint(self, load_dir, tag=None, trust_checkpoint: bool = False, **kwargs):
        """DeepSpeed's ``load_checkpoint`` plus the maximus state. Every file is first read with
        ``weights_only=True`` (DeepSpeed's own, which it then loads itself, included); ``trust_checkpoint=True``
        loads a checkpoint the user wrote whose files need other types (see :mod:`ds_maximus.safe_load`); so does
        ``maximus.trust_checkpoint`` in the ds_config, for callers that cannot pass it (HF Trainer's resume)."""
        from ds_maximus.safe_load import check_deepspeed_folder
        trust_checkpoint = trust_checkpoint or self.cfg.trust_checkpoint
        latest = os.path.join(load_dir, "latest")
        ds_tag = tag if tag is not None else (open(latest).read().strip() if os.path.isfile(latest) else None)
        if ds_tag is not None:
            check_deepspeed_folder(os.path.join(load_dir, str(ds_tag)), trust=trust_checkpoint)
            if self.cfg.distributed.shard_mode != ShardMode.PARTITIONED:
                from ds_maximus.distributed.repartition import check_whole_state
                check_whole_state(os.path.join(load_dir, str(ds_tag)))
        state = None
        if ds_tag is not None and self.cfg.distributed.shard_mode == ShardMode.REPLICATED:
            state = self._replicated_state(os.path.join(load_dir, str(ds_tag)), trust_checkpoint)
        try:
            load_path, client_state = self._orig["load_checkpoint"](load_dir, tag=tag, **kwargs)
        except Exception as e:  # DeepSpeed's refusal of another world size under ZeRO-1/2/3, said as ours
            from ds_maximus.distributed.checkpoint_world import zero_world_size_error
            err = zero_world_size_error(e, self.engine, load_dir, ds_tag)
            if err is None:
                raise
            raise err from e
        if load_path is None:
            return load_path, client_state
        if tag is None:
            with open(os.path.join(load_dir, "latest")) as f:
                tag = f.read().strip()
        if self.cfg.distributed.shard_mode == ShardMode.PARTITIONED:
            from ds_maximus.distributed.repartition import load_partitioned_checkpoint
            self.steps, self.skipped_steps = load_partitioned_checkpoint(os.path.join(load_dir, str(tag)),
                                                                         self.modules, trust=trust_checkpoint)
            return load_path, client_state
        path = os.path.join(load_dir, str(tag), STATE_FILE)
        if self.cfg.distributed.shard_mode == ShardMode.BROADCAST:  # the master reads, the others receive
            from ds_maximus.distributed.broadcast import load_broadcast_state
            state = load_broadcast_state(path, self.cfg, self._dp_group(), trust=trust_checkpoint,
                                         modules=self.modules)  # the tables' rows stay on the master
        elif not os.path.exists(path):
            from ds_maximus.distributed.repartition import missing_whole_state
            raise missing_whole_state(os.path.join(load_dir, str(tag)), path)
        elif state is None or str(tag) != str(ds_tag):
            from ds_maximus.safe_load import safe_torch_load
            state = safe_torch_load(path, trust=trust_checkpoint)
        for n, m in self.modules.items():
            m.load_maximus_state_dict(state["modules"][n])
        self.steps = state["steps"]
        self.skipped_steps = state["skipped_steps"]
        return load_path, client_state
