"""Auto device mapping (HybridFlow §6): placement search, cost simulator, calibration and remap advisor.

Pure Python (no torch, no Ray): it plans; launching pools and workers from its fragment is the trainer's job.
Stability: experimental.
"""

from __future__ import annotations

from hybridflow.placement.advisor import Recommendation, RemapCosts, RunAdvisor, advise_remap, decide_remap
from hybridflow.placement.calibration import compare_nodes, fit_efficiency, fit_efficiency_to_runs, read_ledger
from hybridflow.placement.cost_model import CostModel, cost_models, lookup_cost_models
from hybridflow.placement.dataflow import ALGORITHMS, Dataflow, Stage, Workload, get_dataflow
from hybridflow.placement.fragment import build_fragment, validate_fragment
from hybridflow.placement.memory import MemoryFloor, compute_memory_floor
from hybridflow.placement.models import LLAMA_PRESETS, ModelSpec, model_from_hf_config, parse_model
from hybridflow.placement.parallel import GenerationConfig, ParallelConfig, estimate_transition_bytes
from hybridflow.placement.profiles import DEVICE_PROFILES, Cluster, DeviceProfile, Efficiency, build_cluster
from hybridflow.placement.record import PlanInputs, PlanRecord, load_plan_record, save_plan_record
from hybridflow.placement.search import Plan, SearchResult, search_placements, set_partitions
from hybridflow.placement.simulator import Simulator

__all__ = [
    "ALGORITHMS", "Cluster", "CostModel", "DEVICE_PROFILES", "Dataflow", "DeviceProfile", "Efficiency",
    "GenerationConfig", "LLAMA_PRESETS", "MemoryFloor", "ModelSpec", "ParallelConfig", "Plan", "PlanInputs",
    "PlanRecord", "Recommendation", "RemapCosts", "RunAdvisor", "SearchResult", "Simulator", "Stage", "Workload",
    "advise_remap", "build_cluster", "build_fragment", "compare_nodes", "compute_memory_floor", "cost_models",
    "decide_remap",
    "estimate_transition_bytes", "fit_efficiency", "fit_efficiency_to_runs", "get_dataflow", "load_plan_record",
    "lookup_cost_models", "model_from_hf_config", "parse_model", "read_ledger", "save_plan_record",
    "search_placements", "set_partitions", "validate_fragment",
]
