"""3D-HybridEngine resharding: training/generation meshes, per-parameter shard specs, the reshard planner with
its lower bound and baselines, and the executor over torch.distributed.

Engines describe their layouts with these types; moving weights into an engine is left to the engine plugins.
Stability: public unless a name says otherwise.
"""

from hybridflow.resharding.assign import Transfer
from hybridflow.resharding.builders import (
    PARAM_KINDS,
    ParamKind,
    build_fsdp_layout,
    build_tensor_parallel_layout,
    classify_llama_param,
    named_shapes_of,
    tiny_llama_shapes,
)
from hybridflow.resharding.executor import ReshardStats, execute_reshard
from hybridflow.resharding.layout import (
    MESH_AXES,
    GenerationCoords,
    GenerationLayout,
    Grouping,
    MeshAxis,
    ParallelLayout,
    TrainingCoords,
)
from hybridflow.resharding.parking import Home, StorageParking, parking_cells, parking_homes
from hybridflow.resharding.planner import (
    STRATEGIES,
    Bucket,
    CollectiveOp,
    ReshardPlan,
    Strategy,
    lower_bound_bytes,
    plan_reshard,
)
from hybridflow.resharding.resident import count_storage_bytes
from hybridflow.resharding.specs import Box, FusedLayout, ModelLayout, ParamShardSpec, Piece

__all__ = [
    "MESH_AXES", "MeshAxis", "Grouping", "ParallelLayout", "GenerationLayout", "TrainingCoords", "GenerationCoords",
    "Box", "Piece", "FusedLayout", "ParamShardSpec", "ModelLayout",
    "ParamKind", "PARAM_KINDS", "classify_llama_param", "build_fsdp_layout", "build_tensor_parallel_layout",
    "named_shapes_of", "tiny_llama_shapes",
    "Strategy", "STRATEGIES", "Transfer", "CollectiveOp", "Bucket", "ReshardPlan", "plan_reshard",
    "lower_bound_bytes",
    "ReshardStats", "execute_reshard", "count_storage_bytes",
    "Home", "parking_cells", "parking_homes", "StorageParking",
]
