"""flashdraft: DFlash block-diffusion speculative decoding for any Hugging Face decoder-only model."""

from .config import DFlashConfig, DFlashConfigError, build_target_layer_ids
from .drafter_files import DFlashCheckpointError
from .generate import GenerationError, GenerationResult, generate, generate_ar, generate_batch
from .grammar import Constraint, GrammarError
from .model import DFlashDraftModel, DraftContextCache
from .multimodal import ImageError, ImagePrompt, encode_image_prompt
from .proposers import DFlashProposer, NoProposer, Proposer
from .sampling import SamplingError, SamplingParams
from .target import DraftTargetMismatchError, Target, TargetError, load_target

__version__ = "0.1.0"

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
]
