"""Runs seam cells in groups of processes: all cells of one parallelism mode share one group of ranks
(gloo on 127.0.0.1; one process and no process group for "local"), so a start is paid per mode, not per cell.

The ranks fork from a forkserver (a fresh interpreter with torch imported), not from the test process: after
the test process has run OpenMP regions on several threads (any earlier multi-threaded test in the suite), a
child forked from it hangs in its first OpenMP region (libgomp's pool does not survive fork; seen as both ranks
stuck in a bf16 GEMM).

Each rank appends one JSON line per cell to its own file as soon as the cell ends, so a group that hangs or
dies still reports every cell before the one it stopped at. A cell passes when every rank reports "ok".
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import time
import traceback
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
from _seam_cells import TOL, low_precision, reference, trained
from _seam_states import boundary_flips_allowed, storage_problem
from _seam_table import Cell, verdict

from gradacc_ext.distributed import oom_records

WORLD = {"local": 1, "ddp_buffer": 2, "ddp_overlap": 2, "fsdp_window": 2, "fsdp_micro": 2, "hsdp": 4}
# The peer watch's timers (read when its thread starts): a stall limit below the slow peer's SLOW_S, so a watch
# that took a healthy slow peer for one that gave up would end a rank within the run.
FAST_WATCH = {"GRADACC_PEER_WATCH_POLL_S": "0.05", "GRADACC_PEER_WATCH_STALL_S": "0.3"}


def _snapshot(parts) -> list[torch.Tensor]:
    model, opt = parts[0], parts[1]
    states = [t for s in getattr(opt, "optimizer", opt).state.values() for t in s.values() if torch.is_tensor(t)]
    return [t.detach().clone() for t in (*trained(model, opt)[: len(list(model.parameters()))], *states)]


def _compare(cell: Cell, model: torch.nn.Module, opt: torch.optim.Optimizer, world: int) -> tuple[bool, str]:
    """(True, "equal") when the parameters and optimizer state equal the plain loop's (a low-bit cell: but for a few
    elements at a rounding boundary, counted in the message; _seam_states.py), else (False, what differs)."""
    tol = TOL[not low_precision(cell)]
    got, want = trained(model, opt), reference(cell, world)
    if len(got) != len(want):
        return False, f"{len(got)} parameters and state tensors, the plain loop has {len(want)}"
    count, flips = len(list(model.parameters())), 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        what = f"parameter {i}" if i < count else f"optimizer state tensor {i - count}"
        if g.dtype != w.dtype and i >= count:  # the storage (fp32 / bf16 / int8 codes and scales) is the plain loop's
            return False, f"{what} is {g.dtype}, the plain loop's is {w.dtype}"
        g, w = g.to(torch.float64), w.to(torch.float64)  # int8 states: their codes compare as numbers
        wrong = int((~torch.isclose(g, w, **tol)).sum())
        if wrong > boundary_flips_allowed(cell, w.numel()):
            max_diff = (g - w).abs().max().item()
            return False, f"{what}: max |accumulated - plain loop| = {max_diff:.3g} ({tol}) at {wrong} of {w.numel()}"
        flips += wrong
    problem = storage_problem(cell, model, opt)
    return not problem, problem or ("equal" if not flips else f"equal but for {flips} elements at a rounding boundary")


def _run_cell(cell: Cell, rank: int, world: int, phase: str, ckpt: str) -> tuple[bool, str]:
    from _seam_entries import build, run_loop

    want = verdict(cell)
    if phase == "run" and cell.event == "checkpoint":  # its first group trains to the mid-window checkpoint
        phase = "save"
    parts = None
    try:
        if cell.entry == "lightning":  # the Trainer builds everything inside fit()
            from _seam_lightning import run_lightning

            model, opt, finished = run_lightning(cell, rank, world, phase, ckpt)
        else:
            parts = build(cell, rank, world)
            before = _snapshot(parts)

            def before_save() -> None:  # a refused checkpoint must leave what the micro-batches before it wrote
                before[:] = _snapshot(parts)

            finished = run_loop(cell, rank, world, phase, ckpt, parts, before_save)
            model, opt = parts[0], parts[1]
    except Exception as error:  # a refusal, or a failure of the cell
        text = f"{type(error).__name__}: {error}"
        if want.kind != "refused":
            return False, f"raised {text}\n{traceback.format_exc(limit=-4)}"
        chain = [error, *([error.__cause__] if error.__cause__ is not None else [])]  # a peer error chains it
        if not any(re.search(want.match, str(e)) for e in chain):
            return False, f"refused with an unexpected message: {text}"
        if os.listdir(ckpt):
            return False, f"refused ({text}) after writing {sorted(os.listdir(ckpt))} to the checkpoint folder"
        if parts is not None:
            after = _snapshot(parts)
            if len(after) != len(before) or not all(torch.equal(a, b) for a, b in zip(after, before, strict=True)):
                return False, f"refused ({text}) after writing parameters or optimizer state"
        return True, f"refused: {text}"
    finally:
        if parts is not None:
            parts[-1].close()
    if want.kind == "refused":
        return False, "ran to the end; the table says it must be refused"
    if not finished:
        return True, "saved"
    return _compare(cell, model, opt, world)


def _worker(rank: int, world: int, port: int, cells: list[Cell], phase: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(world), "RANK": str(rank)}
    os.environ.update(env, LOCAL_RANK=str(rank), **FAST_WATCH)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    with open(os.path.join(out_dir, f"{phase}-rank{rank}.jsonl"), "a") as out:
        for cell in cells:
            if world > 1:  # each cell starts without an earlier cell's out-of-memory record (its rank's latest)
                dist.barrier()
                oom_records.write(rank, oom_records.RECOVERED)
                dist.barrier()
            ckpt = os.path.join(out_dir, "ckpt", cell.id)
            os.makedirs(ckpt, exist_ok=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ok, message = _run_cell(cell, rank, world, phase, ckpt)
            seen = sorted({str(w.message)[:200] for w in caught})
            out.write(json.dumps({"cell": cell.id, "ok": ok, "message": message, "warnings": seen}) + "\n")
            out.flush()
    if world > 1:
        dist.destroy_process_group()


def run_group(parallel: str, cells: list[Cell], phase: str, out_dir: str, timeout: float) -> dict[str, dict]:
    """Runs `cells` (all of mode `parallel`) in one group; per cell: {"ok", "message", "warnings"}."""
    from _dist import free_port

    world = WORLD[parallel]
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "_seam_groups"])
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, cells, phase, out_dir)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    results: dict[str, dict] = {}
    for rank in range(world):
        path = os.path.join(out_dir, f"{phase}-rank{rank}.jsonl")
        lines = open(path).read().splitlines() if os.path.exists(path) else []
        for line in lines:
            row = json.loads(line)
            seen = results.setdefault(row["cell"], {"ok": True, "message": "", "warnings": [], "ranks": 0})
            seen["ranks"] += 1
            seen["warnings"] = sorted(set(seen["warnings"]) | set(row["warnings"]))
            if not row["ok"] and seen["ok"]:
                seen.update(ok=False, message=f"rank {rank}: {row['message']}")
            elif seen["ok"]:
                seen["message"] = row["message"]
    exits = [p.exitcode for p in procs]
    for cell in cells:
        row = results.get(cell.id)
        if row is None or row["ranks"] < world:
            results[cell.id] = {"ok": False, "message": f"not finished on every rank (exit codes {exits})",
                                "warnings": row["warnings"] if row else []}  # fmt: skip
    return results
