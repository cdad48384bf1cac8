"""``comfuse tune``: MetaSchedule tuning of the fused PrimFuncs ComFuse produces.

The tuning logs are a standard MetaSchedule JSONDatabase (``database_workload.json`` and
``database_tuning_record.json``) that ``tvm_comfuse.get_pipeline(target, database=DIR)``
applies at compile time. Modules:

* :mod:`.registry` - named workloads and TVMScript files, as Relax modules;
* :mod:`.tasks` - the tuning tasks (fused PrimFuncs) of a module;
* :mod:`.space` - the search space per task kind (the hook for the ComFuse GPU rule);
* :mod:`.logs` - the work directory: its meta file, log validation, record counts, lossless compaction;
* :mod:`.measure` - the builder and runner (local or through an RPC tracker);
* :mod:`.driver` - the resumable tuning loop with its progress bar;
* :mod:`.summary` - the human summary and the "tuned vs default" report after compiling;
* :mod:`.representative` - symbolic shapes tuned at a representative size (``--bind``).
"""

from .driver import TuneOptions, TuneResult, tune
from .logs import WorkDir, default_work_dir
from .registry import WORKLOADS, load_workload
from .representative import parse_bind
from .summary import applied_from_database
from .tasks import Task, extract_tasks

__all__ = [
    "TuneOptions",
    "TuneResult",
    "tune",
    "WorkDir",
    "default_work_dir",
    "WORKLOADS",
    "load_workload",
    "parse_bind",
    "applied_from_database",
    "Task",
    "extract_tasks",
]
