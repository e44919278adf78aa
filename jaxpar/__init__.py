"""jaxpar: MindSpore-style automatic parallelism for JAX.

Write single-device JAX; jaxpar traces it, chooses a sharding for every operator (given by you,
propagated, or searched), emits ``NamedSharding`` constraints and lets XLA insert the collectives.

>>> import jaxpar
>>> mesh = jaxpar.make_mesh((2, 4), ("dp", "mp"))
"""

from jaxpar import dataset as dataset
from jaxpar import inspect as inspect
from jaxpar import metrics as metrics
from jaxpar import ps as ps
from jaxpar._src.amp.loss_scale import DynamicLossScaleManager as DynamicLossScaleManager
from jaxpar._src.amp.loss_scale import FixedLossScaleManager as FixedLossScaleManager
from jaxpar._src.amp.loss_scale import LossScaleState as LossScaleState
from jaxpar._src.amp.loss_scale import all_finite as all_finite
from jaxpar._src.amp.precision import auto_mixed_precision as auto_mixed_precision
from jaxpar._src.api import Parallelized as Parallelized
from jaxpar._src.api import parallelize as parallelize
from jaxpar._src.calibrate import calibrate as calibrate
from jaxpar._src.checkpoint.infer import infer_predict_layout as infer_predict_layout
from jaxpar._src.checkpoint.layouts import ArrayLayout as ArrayLayout
from jaxpar._src.checkpoint.layouts import ParameterLayouts as ParameterLayouts
from jaxpar._src.checkpoint.load import load_distributed_checkpoint as load_distributed_checkpoint
from jaxpar._src.checkpoint.merge import merge_sliced_parameter as merge_sliced_parameter
from jaxpar._src.checkpoint.save import save_checkpoint as save_checkpoint
from jaxpar._src.checkpoint.transform import transform_checkpoints as transform_checkpoints
from jaxpar._src.config import config as config
from jaxpar._src.context import ParallelMode as ParallelMode
from jaxpar._src.context import auto_parallel_context as auto_parallel_context
from jaxpar._src.context import get_algo_parameters as get_algo_parameters
from jaxpar._src.context import get_auto_parallel_context as get_auto_parallel_context
from jaxpar._src.context import reset_algo_parameters as reset_algo_parameters
from jaxpar._src.context import reset_auto_parallel_context as reset_auto_parallel_context
from jaxpar._src.context import set_algo_parameters as set_algo_parameters
from jaxpar._src.context import set_auto_parallel_context as set_auto_parallel_context
from jaxpar._src.errors import CheckpointError as CheckpointError
from jaxpar._src.errors import ContextError as ContextError
from jaxpar._src.errors import DatasetError as DatasetError
from jaxpar._src.errors import JaxparError as JaxparError
from jaxpar._src.errors import JaxparWarning as JaxparWarning
from jaxpar._src.errors import MeshError as MeshError
from jaxpar._src.errors import PlanError as PlanError
from jaxpar._src.errors import PSError as PSError
from jaxpar._src.errors import StrategyError as StrategyError
from jaxpar._src.execution import GRAPH_MODE as GRAPH_MODE
from jaxpar._src.execution import PYNATIVE_MODE as PYNATIVE_MODE
from jaxpar._src.execution import get_context as get_context
from jaxpar._src.execution import set_context as set_context
from jaxpar._src.hardware import HardwareProfile as HardwareProfile
from jaxpar._src.hardware import calibration_path as calibration_path
from jaxpar._src.launch.comm import get_group_size as get_group_size
from jaxpar._src.launch.comm import get_local_rank as get_local_rank
from jaxpar._src.launch.comm import get_rank as get_rank
from jaxpar._src.launch.comm import init as init
from jaxpar._src.layout import Layout as Layout
from jaxpar._src.mesh import make_mesh as make_mesh
from jaxpar._src.optimizer_parallel import OptimizerParallel as OptimizerParallel
from jaxpar._src.pipeline.cell import PipelineCell as PipelineCell
from jaxpar._src.pipeline.markers import pipeline_stage as pipeline_stage
from jaxpar._src.pipeline.report import PipelinePlan as PipelinePlan
from jaxpar._src.pipeline.schedule import PipelineSchedule as PipelineSchedule
from jaxpar._src.pipeline.schedule import Timeline as Timeline
from jaxpar._src.pipeline.stacked import StackedParams as StackedParams
from jaxpar._src.plan import OpDecision as OpDecision
from jaxpar._src.plan import ShardingPlan as ShardingPlan
from jaxpar._src.ps.context import get_ps_context as get_ps_context
from jaxpar._src.ps.context import reset_ps_context as reset_ps_context
from jaxpar._src.ps.context import set_ps_context as set_ps_context
from jaxpar._src.recompute import recompute as recompute
from jaxpar._src.report.build import Report as Report
from jaxpar._src.report.diff import PlanDiff as PlanDiff
from jaxpar._src.rules import OpCategory as OpCategory
from jaxpar._src.rules import OpView as OpView
from jaxpar._src.rules import register_rule as register_rule
from jaxpar._src.rules.factors import FactorRule as FactorRule
from jaxpar._src.rules.factors import RuleBuilder as RuleBuilder
from jaxpar._src.shard import shard as shard
from jaxpar._src.train.callbacks import Callback as Callback
from jaxpar._src.train.callbacks import CallbackParams as CallbackParams
from jaxpar._src.train.callbacks import CheckpointConfig as CheckpointConfig
from jaxpar._src.train.callbacks import LossMonitor as LossMonitor
from jaxpar._src.train.callbacks import ModelCheckpoint as ModelCheckpoint
from jaxpar._src.train.callbacks import ProgressBar as ProgressBar
from jaxpar._src.train.callbacks import RunContext as RunContext
from jaxpar._src.train.callbacks import TimeMonitor as TimeMonitor
from jaxpar._src.train.callbacks import load_checkpoint as load_checkpoint
from jaxpar._src.train.model import Model as Model
from jaxpar._src.train.reducer import DistributedGradReducer as DistributedGradReducer
from jaxpar._src.train.replicas import PerReplica as PerReplica
from jaxpar._src.train.replicas import per_replica as per_replica
from jaxpar._src.train.seed import get_seed as get_seed
from jaxpar._src.train.seed import parameter_broadcast as parameter_broadcast
from jaxpar._src.train.seed import random_key as random_key
from jaxpar._src.train.seed import set_seed as set_seed

__version__ = "0.1.0"

__all__ = [
    "ArrayLayout", "CheckpointError", "ParameterLayouts", "infer_predict_layout",
    "load_distributed_checkpoint", "merge_sliced_parameter", "save_checkpoint",
    "transform_checkpoints",
    "Callback", "CallbackParams", "CheckpointConfig", "ContextError", "DatasetError",
    "DistributedGradReducer", "DynamicLossScaleManager", "FactorRule", "FixedLossScaleManager",
    "GRAPH_MODE", "HardwareProfile", "JaxparError", "JaxparWarning", "Layout", "LossMonitor",
    "LossScaleState", "MeshError", "Model", "ModelCheckpoint", "OpCategory", "OpDecision",
    "OpView", "PSError",
    "PYNATIVE_MODE", "ParallelMode", "Parallelized", "PerReplica", "PlanError", "ProgressBar",
    "RuleBuilder", "RunContext", "ShardingPlan", "StrategyError", "TimeMonitor", "all_finite",
    "auto_mixed_precision", "auto_parallel_context", "calibrate", "calibration_path", "dataset",
    "get_algo_parameters",
    "get_auto_parallel_context", "get_context", "get_group_size", "get_local_rank",
    "get_ps_context", "get_rank", "get_seed", "init", "inspect", "load_checkpoint", "make_mesh",
    "metrics", "parallelize", "parameter_broadcast", "per_replica", "ps", "random_key",
    "register_rule", "reset_algo_parameters", "reset_auto_parallel_context", "reset_ps_context",
    "set_algo_parameters", "set_auto_parallel_context", "set_context", "set_ps_context",
    "set_seed", "shard",
    "PlanDiff", "Report",  # plan reports
    "PipelineCell", "PipelinePlan", "PipelineSchedule", "StackedParams", "Timeline",
    "pipeline_stage",
    "recompute",
    "config",  # process-wide settings: plan_cache_dir
    "OptimizerParallel",  # ZeRO 1/2/3 (enable_parallel_optimizer)
]
