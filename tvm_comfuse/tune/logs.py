"""The work directory: MetaSchedule's JSON logs plus ``comfuse_meta.json``, checked before use.

Everything here reads; nothing rewrites a log, except :func:`compact` when asked to (losslessly,
checked before it replaces a file). Checks run before MetaSchedule opens the
database (which would append to it), so a bad work directory is reported with the file and
line at fault and left byte-identical. ``comfuse_meta.json`` records the target and TVM
version the logs were measured with: a record tuned for another target or TVM build is not
a valid measurement here, and MetaSchedule would silently ignore or misapply it.
"""

from __future__ import annotations

import base64
import json
import os
import re
import struct
import tempfile

import tvm
import tvm_ffi
from tvm.s_tir import meta_schedule as ms

from ..errors import ComFuseError

WORKLOAD_FILE = "database_workload.json"
RECORD_FILE = "database_tuning_record.json"
META_FILE = "comfuse_meta.json"
#: run_secs MetaSchedule records for a candidate that failed to build or run.
FAILED_SECS = 1e9


def mean_secs(run_secs) -> float:
    """A record's time as MetaSchedule ranks records, the mean of its runs; FAILED_SECS for a
    failed build or run (no runs, or one at FAILED_SECS or more: MetaSchedule's own mark is 1e10)."""
    secs = [float(s) for s in run_secs or []]
    return sum(secs) / len(secs) if secs and max(secs) < FAILED_SECS else FAILED_SECS


def target_name(target: tvm.target.Target) -> str:
    """A directory name for ``target``: its tag, else kind and arch/mcpu (``cuda-sm_90``, ``llvm``)."""
    tag = str(target.attrs.get("tag", "") or getattr(target, "tag", "") or "")
    if tag:
        name = tag
    else:
        detail = target.attrs.get("arch") or target.attrs.get("mcpu")
        name = f"{target.kind.name}-{detail}" if detail else target.kind.name
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name)


def default_work_dir(target: tvm.target.Target, workload: str) -> str:
    """``tuning_logs/<target-name>/<workload>/``."""
    return os.path.join("tuning_logs", target_name(target), re.sub(r"[^A-Za-z0-9_.-]+", "_", workload))


def read_meta(path: str) -> dict | None:
    """The ``comfuse_meta.json`` of the log directory ``path`` (None if it has none)."""
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_path):
        return None
    try:
        with open(meta_path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ComFuseError(f"{meta_path}: unreadable ({err})") from None


class WorkDir:
    """A tuning work directory for one target; :meth:`check` before :meth:`database`."""

    def __init__(self, path: str, target: tvm.target.Target, bind: dict | None = None):
        self.path = path
        self.target = target
        self.bind = dict(bind or {})  # symbolic shape variables bound for tuning (``--bind``)
        self.workload_path = os.path.join(path, WORKLOAD_FILE)
        self.record_path = os.path.join(path, RECORD_FILE)
        self.meta_path = os.path.join(path, META_FILE)

    # -- checks ---------------------------------------------------------------------------
    def expected_meta(self) -> dict:
        meta = {"target": str(self.target), "tvm_version": tvm.__version__}
        return {**meta, "bind": self.bind} if self.bind else meta

    def check(self) -> None:
        """Raise :class:`ComFuseError` if the logs here belong elsewhere or do not parse."""
        if os.path.exists(self.path) and not os.path.isdir(self.path):
            raise ComFuseError(f"work dir {self.path!r} exists and is not a directory")
        self._check_meta()
        self.scan()

    def _check_meta(self) -> None:
        meta = read_meta(self.path)
        if meta is None:
            return
        want = self.expected_meta()
        for key, what in (("target", "target"), ("tvm_version", "TVM version")):
            if meta.get(key) != want[key]:
                raise ComFuseError(
                    f"{self.path}: these logs were tuned for {what} {meta.get(key)!r}, not {want[key]!r} "
                    f"({self.meta_path}). Records do not transfer between targets or TVM versions: "
                    "use another --work-dir (the default one is per target)."
                )
        if meta.get("bind", {}) != self.bind:
            raise ComFuseError(
                f"{self.path}: these logs were tuned with symbolic shapes bound to {meta.get('bind', {})}, not {self.bind} "
                f"({self.meta_path}); a compile looks records up at one size: tune with the same --bind, or use another --work-dir."
            )

    def scan(self) -> tuple[list[str], list]:
        """Validate both logs line by line: ``(workload hashes, [(workload index, run_secs)])``."""
        hashes = [entry[0] for entry in self._lines(self.workload_path, self._workload_entry)]
        records = []
        for lineno, entry in enumerate(self._lines(self.record_path, self._record_entry), 1):
            index, record = entry
            if not 0 <= index < len(hashes):
                raise self._corrupt(self.record_path, lineno, f"workload index {index} not in {WORKLOAD_FILE} ({len(hashes)} workloads)")
            kind = record[2].get("kind") if isinstance(record[2], dict) else None
            if kind != self.target.kind.name:
                raise ComFuseError(
                    f"{self.record_path}, line {lineno}: a record measured on target kind {kind!r}, "
                    f"not {self.target.kind.name!r}. Use another --work-dir for this target."
                )
            records.append((index, record[1]))
        return hashes, records

    @staticmethod
    def _workload_entry(entry) -> bool:
        return isinstance(entry, list) and len(entry) == 2 and all(isinstance(e, str) for e in entry)

    @staticmethod
    def _record_entry(entry) -> bool:
        return (
            isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], int)
            and isinstance(entry[1], list) and len(entry[1]) == 4
        )

    @staticmethod
    def _lines(path: str, valid):
        if not os.path.isfile(path):
            return
        with open(path, "rb") as f:
            data = f.read()
        lines = data.split(b"\n")
        for lineno, raw in enumerate(lines, 1):
            if not raw.strip():
                if lineno < len(lines):
                    raise WorkDir._corrupt(path, lineno, "empty line")
                continue
            try:
                entry = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                last = lineno == len(lines)
                raise WorkDir._corrupt(path, lineno, ("truncated: " if last else "") + f"not JSON ({err.msg})") from None
            if not valid(entry):
                raise WorkDir._corrupt(path, lineno, "not a MetaSchedule entry")
            yield entry

    @staticmethod
    def _corrupt(path: str, lineno: int, why: str) -> ComFuseError:
        return ComFuseError(
            f"{path}, line {lineno}: corrupted tuning log ({why}). The log was left untouched; "
            f"keep lines 1-{lineno - 1} (e.g. `head -n {lineno - 1}`) to recover the records before it, "
            "or tune into another --work-dir."
        )

    # -- use ------------------------------------------------------------------------------
    def run_secs_for(self, mod: tvm.IRModule) -> list:
        """The mean run time of every record (good or failed) the logs hold for the task ``mod``."""
        hashes, records = self.scan()
        shash = str(tvm_ffi.structural_hash(mod))
        mine = {i for i, h in enumerate(hashes) if h == shash}
        return [sum(secs) / len(secs) if secs else FAILED_SECS for i, secs in records if i in mine]

    def open(self) -> ms.database.JSONDatabase:
        """Create the directory and meta file if needed; the JSONDatabase (appends as it measures)."""
        from ..pipeline import register_tensor_intrinsics  # pylint: disable=import-outside-toplevel
        from ..target import is_gpu  # pylint: disable=import-outside-toplevel

        if is_gpu(self.target):
            register_tensor_intrinsics(self.record_path)  # GPU records name them; the database parses every record
        os.makedirs(self.path, exist_ok=True)
        if not os.path.isfile(self.meta_path):
            with open(self.meta_path, "w", encoding="utf-8") as f:
                json.dump(self.expected_meta(), f, indent=1)
                f.write("\n")
        return ms.database.JSONDatabase(path_workload=self.workload_path, path_tuning_record=self.record_path)


def _compact_json(text: str) -> str:
    return json.dumps(json.loads(text), separators=(",", ":"))


def _compact_strings(value):
    """``value`` with every string that holds an indented JSON document (TVM's ``SaveJSON`` of an
    IndexMap in a TransformLayout instruction) written without the indentation."""
    if isinstance(value, str) and value.startswith("{\n"):
        try:
            return _compact_json(value)
        except ValueError:
            return value
    if isinstance(value, list):
        return [_compact_strings(v) for v in value]
    return value


def _compact_workload(line: bytes) -> str:
    """A workload line ``[hash, base64(8-byte length + SaveJSON text)]`` with the text compacted."""
    shash, payload = json.loads(line)
    raw = base64.b64decode(payload)
    (size,) = struct.unpack("<Q", raw[:8])
    if size + 8 != len(raw):
        raise ComFuseError(f"a workload entry of hash {shash} is not a length-prefixed JSON document; not compacted")
    text = _compact_json(raw[8:].decode()).encode()
    return json.dumps([shash, base64.b64encode(struct.pack("<Q", len(text)) + text).decode()])


def _same_database(path_a: str, path_b: str) -> bool:
    """Whether two log directories load as the same MetaSchedule database: the same records in
    order, each with the same trace, run times, target and arguments, of the same workload."""
    from ..pipeline import register_tensor_intrinsics  # pylint: disable=import-outside-toplevel

    register_tensor_intrinsics(os.path.join(path_a, RECORD_FILE))
    load = lambda p: ms.database.JSONDatabase(os.path.join(p, WORKLOAD_FILE), os.path.join(p, RECORD_FILE),  # noqa: E731
                                              allow_missing=False).get_all_tuning_records()
    a, b = load(path_a), load(path_b)
    return len(a) == len(b) and all(
        str(x.trace) == str(y.trace) and [float(s) for s in x.run_secs or []] == [float(s) for s in y.run_secs or []]
        and str(x.target) == str(y.target) and str(x.args_info) == str(y.args_info)
        and tvm_ffi.structural_equal(x.workload.mod, y.workload.mod)
        for x, y in zip(a, b)
    )


def compact(path: str) -> tuple[int, int]:
    """Rewrite the logs in ``path`` without the indentation TVM's JSON writer leaves inside them
    (each workload's IRModule and each TransformLayout's index map are indented JSON documents
    nested as strings: half of a GPU log's bytes). Lossless: the compacted files are written
    beside the originals and replace them only if they load as the same database
    (:func:`_same_database`); MetaSchedule appends to them as before. Returns the bytes of both
    files before and after. Why: the shipped logs travel with the repository."""
    files = [os.path.join(path, f) for f in (WORKLOAD_FILE, RECORD_FILE)]
    if not all(os.path.isfile(f) for f in files):
        raise ComFuseError(f"{path!r} is not a MetaSchedule log directory (it needs {WORKLOAD_FILE} and {RECORD_FILE})")
    for name, valid in ((WORKLOAD_FILE, WorkDir._workload_entry), (RECORD_FILE, WorkDir._record_entry)):
        for _ in WorkDir._lines(os.path.join(path, name), valid):  # a corrupted line: its file and number  # pylint: disable=protected-access
            pass
    before = sum(os.path.getsize(f) for f in files)
    with tempfile.TemporaryDirectory(prefix=".compact-", dir=path) as tmp:
        for name, rewrite in ((WORKLOAD_FILE, _compact_workload),
                              (RECORD_FILE, lambda line: json.dumps(_compact_strings(json.loads(line)), separators=(",", ":")))):
            with open(os.path.join(path, name), "rb") as src, open(os.path.join(tmp, name), "w", encoding="utf-8") as dst:
                for line in src:
                    if line.strip():
                        dst.write(rewrite(line) + "\n")
        if not _same_database(path, tmp):
            raise ComFuseError(f"{path}: the compacted logs do not load as the same records; the logs were left untouched")
        for name in (WORKLOAD_FILE, RECORD_FILE):
            os.replace(os.path.join(tmp, name), os.path.join(path, name))
    return before, sum(os.path.getsize(f) for f in files)
