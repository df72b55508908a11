"""Per-rank result files, resuming and merging, for one process or many.

Each process (rank r of W, from the RANK / WORLD_SIZE / LOCAL_RANK variables that
``accelerate launch`` and ``torchrun`` set; 0 of 1 otherwise) evaluates every W-th group of
samples (a group: the questions about one video, so each video is decoded by one rank only)
and appends one JSON line per sample to ``samples.rank<r>.jsonl``, flushed as it goes. On a
restart every rank reads the ids already answered in all rank files (a half-written last line
is cut off) and skips them, so nothing is lost or counted twice, even if W changed; a record
whose ``status`` is "failed" is tried again, and a later success replaces it. Rank 0 waits
until every expected id is on disk, then writes ``results.jsonl`` with each id once.
"""
from __future__ import annotations

import datetime
import glob
import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Sequence, TypeVar

T = TypeVar("T")
RANK_FILE = "samples.rank{}.jsonl"
MERGED_FILE = "results.jsonl"


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def current() -> Dist:
    """This process's place, from the launcher's RANK / WORLD_SIZE / LOCAL_RANK."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return Dist(rank, world, local)


def shard(items: Sequence[T], dist: Dist, key: Callable[[T], Hashable] | None = None) -> list[T]:
    """This rank's items: groups rank, rank + W, ... of the items with equal ``key`` (in order of
    first appearance; each item is its own group without a key), every item in exactly one
    shard, returned group by group."""
    if key is None:
        return list(items[dist.rank :: dist.world_size])
    groups: dict[Hashable, list[T]] = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return [item for g in list(groups.values())[dist.rank :: dist.world_size] for item in g]


def status(record: dict[str, Any]) -> str:
    """"ok" (answered), "failed" (raised; retried on the next run) or "skipped" (media missing).
    Records written before statuses existed are failed when they carry an error."""
    return record.get("status", "failed" if record.get("error") else "ok")


def is_failed(record: dict[str, Any]) -> bool:
    return status(record) == "failed"


def _iter_records(path: str) -> Iterator[tuple[dict[str, Any], int]]:
    """(record, end offset) of each complete line; stops at a truncated or corrupt line."""
    with open(path, "rb") as f:
        offset = 0
        for line in f:
            if not line.endswith(b"\n"):
                return
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                return
            offset += len(line)
            yield rec, offset


def read_records(out_dir: str) -> dict[str, dict[str, Any]]:
    """id -> record over all rank files in ``out_dir``: the first answered record of an id wins,
    else its last failed one."""
    done: dict[str, dict[str, Any]] = {}
    for path in sorted(glob.glob(os.path.join(out_dir, RANK_FILE.format("*")))):
        for rec, _ in _iter_records(path):
            key = str(rec["id"])
            if key not in done or is_failed(done[key]):
                done[key] = rec
    return done


class RankWriter:
    """Appends records to this rank's file, one flushed line each, after cutting a torn tail."""

    def __init__(self, out_dir: str, dist: Dist) -> None:
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, RANK_FILE.format(dist.rank))
        if os.path.exists(self.path):
            good = 0
            for _, good in _iter_records(self.path):
                pass
            if good != os.path.getsize(self.path):
                with open(self.path, "r+b") as f:
                    f.truncate(good)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "RankWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: minutes a rank waits for the others at the final sync (``vlm-prune eval --sync-timeout``): ranks
#: finish far apart on long videos, but a rank whose peers died must not hold its GPU for a day
SYNC_TIMEOUT_MIN = 60.0


class SyncTimeout(TimeoutError):
    """The other ranks did not reach the final sync in time (one died, or the launcher did)."""


def barrier(dist: Dist, timeout_min: float = SYNC_TIMEOUT_MIN) -> bool:
    """Wait, at most ``timeout_min`` minutes, for every rank here when the launcher gave a rendezvous
    (MASTER_ADDR / MASTER_PORT, as torchrun and accelerate set); joins the process group first (gloo)
    if nobody has. Returns False, without waiting, for one process or no rendezvous; raises
    :class:`SyncTimeout` when the others do not arrive in time (every answer is already on disk:
    rerunning the same command resumes)."""
    if dist.world_size == 1 or not (os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT")):
        return False
    import torch.distributed as tdist

    timeout = datetime.timedelta(minutes=timeout_min)
    try:
        if not tdist.is_initialized():
            tdist.init_process_group("gloo", rank=dist.rank, world_size=dist.world_size, timeout=timeout)
        tdist.barrier()
    except (RuntimeError, TimeoutError) as err:  # gloo / the store report a timeout or a lost peer so
        raise SyncTimeout(
            f"rank {dist.rank} of {dist.world_size}: the other ranks did not reach the final sync within "
            f"{timeout_min:g} minutes (--sync-timeout) or one of them is gone ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); this rank's answers are on disk: rerun the same "
            "command to finish and merge"
        ) from err
    return True


def wait_for(out_dir: str, ids: Sequence[str], poll_s: float = 1.0, log: Any = None,
             timeout_min: float | None = SYNC_TIMEOUT_MIN) -> dict[str, dict[str, Any]]:
    """Block until every id in ``ids`` has a record in ``out_dir`` (at most ``timeout_min`` minutes;
    None: no limit); returns those records."""
    want = set(ids)
    told = False
    deadline = None if timeout_min is None else time.monotonic() + 60.0 * timeout_min
    while True:
        done = read_records(out_dir)
        missing = want.difference(done)
        if not missing:
            return {i: done[i] for i in ids}
        if deadline is not None and time.monotonic() > deadline:
            raise SyncTimeout(f"{len(missing)} samples are still missing from {out_dir} after {timeout_min:g} minutes "
                              "(--sync-timeout): a rank that should write them is gone; rerun the same command")
        if log is not None and not told:
            log(f"waiting for {len(missing)} samples from the other ranks in {out_dir}")
            told = True
        time.sleep(poll_s)


def exit_with_launcher(dist: Dist, poll_s: float = 2.0) -> bool:
    """Under a launcher (torchrun, accelerate: WORLD_SIZE > 1 and LOCAL_RANK / TORCHELASTIC_RUN_ID set),
    end this rank when the launcher dies (SIGKILL, a lost SSH session) instead of running on and
    waiting at the final sync: a daemon thread polls the parent process and exits with status 75
    (answers already written stay on disk; rerunning resumes). Returns whether it watches."""
    if dist.world_size == 1 or not ("LOCAL_RANK" in os.environ or "TORCHELASTIC_RUN_ID" in os.environ):
        return False
    import sys
    import threading

    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_s)
        sys.stderr.write(f"rank {dist.rank}: the launcher (pid {launcher}) is gone; exiting (answers so far are on "
                         "disk: rerun the same command to resume)\n")
        sys.stderr.flush()
        os._exit(LAUNCHER_GONE)

    threading.Thread(target=watch, name="vlm_prune-launcher-watch", daemon=True).start()
    return True


#: exit status of a rank whose launcher died (EX_TEMPFAIL: rerun to resume)
LAUNCHER_GONE = 75


def write_merged(out_dir: str, records: Sequence[dict[str, Any]]) -> str:
    """Write ``results.jsonl`` (atomically) with the given records in order."""
    path = os.path.join(out_dir, MERGED_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    os.replace(tmp, path)
    return path
