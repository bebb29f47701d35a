"""flashdraft: DFlash block-diffusion speculative decoding for any Hugging Face decoder-only model."""

from ._version import __version__ as __version__
from .drafter.checkpoint import DFlashCheckpointError
from .drafter.config import DFlashConfig, DFlashConfigError, build_target_layer_ids
from .drafter.model import DFlashDraftModel, DraftContextCache
from .engine.grammar import Constraint, GrammarError
from .engine.proposers import DFlashProposer, NoProposer, Proposer
from .generate import GenerationError, GenerationResult, generate, generate_ar, generate_batch
from .pipeline import Pipeline, load_pipeline
from .sampling import SamplingError, SamplingParams
from .targets.multimodal import ImageError, ImagePrompt, encode_image_prompt
from .targets.target import DraftTargetMismatchError, Target, TargetError, load_target

__all__ = [
    "DFlashCheckpointError",
    "DFlashConfig",
    "DFlashConfigError",
    "DFlashDraftModel",
    "DFlashProposer",
    "DraftContextCache",
    "DraftTargetMismatchError",
    "GenerationError",
    "GenerationResult",
    "NoProposer",
    "Pipeline",
    "Proposer",
    "SamplingError",
    "SamplingParams",
    "Target",
    "TargetError",
    "build_target_layer_ids",
    "Constraint",
    "GrammarError",
    "ImageError",
    "ImagePrompt",
    "encode_image_prompt",
    "generate",
    "generate_ar",
    "generate_batch",
    "load_target",
    "load_pipeline",
]
