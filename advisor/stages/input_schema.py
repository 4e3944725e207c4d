"""The one schema of what `sdzero advise --replan FILE|RUN` reads: a profile file, or a training run's
metrics.jsonl, ds_config.json and run_config.json. Declared once, with pydantic (as DeepSpeed checks its
own config): each key's type, its range, finite numbers only, and no key the schema does not know.

A value outside its range once planned nonsense or died deep inside the model: a rate of 1e-308 (an
infinite step), `gpus_per_node: 1e9` (7.45 GiB allocated for one list), `parameters: -5` (planned as a
4M-parameter model), `lr: .nan` (written into the recommended DeepSpeed JSON). Here each is one line
naming the key, what it got and what it takes; a misspelt key is named with the closest known one.

Adding an optional figure is one declaration: a field with its type and range on `ProfileConfigIn` (a
config's measurement, such as a loader's samples/s) or on `ProfileFileIn` (the node's, such as its
storage's bytes/s), with `None` as its default. The readers (advisor.stages.profile_source) get it as an
attribute; files without it keep working.

YAML is parsed safely and within bounds (`load_yaml_bounded`): no Python objects, a nesting depth, and a
bound on the nodes that aliases expand to (an alias bomb of a few hundred bytes expands to billions).
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from advisor.measure.grid import OFFLOADS
from advisor.model.target_compute import MODEL_SHAPES
from advisor.stages.target import TARGET_GPUS
from sdzero.config.user_file import MAX_DEPTH
from sdzero.errors import UserError

MAX_YAML_NODES = 100_000
"""More nodes than any profile needs, once aliases are expanded; a bound on the work the schema does."""

Count = Annotated[int, Field(ge=1, le=1_000_000)]
"""A micro-batch, an accumulation: positive, and small enough to plan for."""
StepSeconds = Annotated[float, Field(ge=1e-4, le=1e7)]
"""An optimizer step: from a tenth of a millisecond to about four months."""
Rate = Annotated[float, Field(ge=1e-6, le=1e12)]
"""A rate (samples/s, files/s, bytes/s): positive and finite, within what a machine can do."""
Gib = Annotated[float, Field(gt=0, le=1e5)]
Elements = Annotated[int, Field(ge=1, le=10**13)]


class StrictIn(BaseModel):
    """Finite numbers, unknown keys refused, and no silent float-to-int rounding."""

    # strict: YAML and JSON give typed values, so `nodes: "4"` or `micro_batch: 8.5` is a mistake to name
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True, strict=True)


class ProfileConfigIn(StrictIn):
    """One config measured on the node (docs/advisor.md section 2c)."""

    zero_stage: Literal[0, 1, 2, 3]
    precision: Literal["bf16", "fp16"]
    micro_batch: Count
    grad_accum: Count = 1
    step_time_s: StepSeconds | None = None
    samples_per_s: Rate | None = None
    """The run's samples/s, all its GPUs'."""
    samples_per_s_per_gpu: Rate | None = None
    memory_gib: Gib | None = None
    """Peak memory per GPU (torch.cuda.max_memory_allocated)."""
    offload: Literal[OFFLOADS] = "none"  # type: ignore[valid-type]

    @model_validator(mode="after")
    def _one_rate(self) -> ProfileConfigIn:
        given = [
            k
            for k in ("step_time_s", "samples_per_s", "samples_per_s_per_gpu")
            if getattr(self, k) is not None
        ]
        if not given:
            raise ValueError(
                "no rate; give step_time_s, samples_per_s (all its GPUs') or samples_per_s_per_gpu"
            )
        if len(given) > 1:
            raise ValueError(f"one rate only, not {' and '.join(given)}")
        return self


class ProfileInputIn(StrictIn):
    """What the node's input measured (docs/advisor.md section 2c): the figures sdzero.data.input_probe
    records in a launch's "input" section, so that a replan from the file is bounded by its input as one
    from an advise folder is (advisor.model.input_rate)."""

    loader_samples_per_s: Rate
    """One loader worker's samples/s (decode, augment, tokenize; or a latent-cache read)."""
    kind: Literal["images", "cache"] = "images"
    workers_per_rank: Annotated[int, Field(ge=1, le=1024)] | None = None
    cpu_count: Annotated[int, Field(ge=1, le=100_000)] | None = None
    """The node's CPU cores (os.cpu_count()), shared by its ranks and their loader workers."""
    storage_bytes_per_s: Rate | None = None
    storage_files_per_s: Rate | None = None
    """The data's location read by the node's readers: bytes/s and files/s (both, or neither)."""

    @model_validator(mode="after")
    def _storage_both(self) -> ProfileInputIn:
        if (self.storage_bytes_per_s is None) != (self.storage_files_per_s is None):
            raise ValueError("give storage_bytes_per_s and storage_files_per_s together (or neither)")
        return self

    def section(self) -> dict[str, Any]:
        """The figures as a launch's "input" section (sdzero.data.input_probe.measure_input's form)."""
        storage = None
        if self.storage_bytes_per_s is not None and self.storage_files_per_s is not None:
            storage = {
                "bytes_per_s": self.storage_bytes_per_s,
                "files_per_s": self.storage_files_per_s,
                "bytes_per_file": self.storage_bytes_per_s / self.storage_files_per_s,
            }
        return {
            "kind": self.kind,
            "worker": {"samples_per_s": self.loader_samples_per_s},
            "storage": storage,
            "workers_per_rank": self.workers_per_rank,
            "cpu_count": self.cpu_count,
        }


class ProfileFileIn(StrictIn):
    """A profile file: what one node (or a few) of the target measured."""

    device: str
    gpus_per_node: Annotated[int, Field(ge=1, le=1024)]
    nodes: Annotated[int, Field(ge=1, le=100_000)] = 1
    configs: Annotated[list[ProfileConfigIn], Field(min_length=1, max_length=256)]
    model: str | None = None
    """A diffusers pipeline folder or a named shape; else `parameters`."""
    parameters: Annotated[int, Field(ge=1, le=10**12)] | None = None
    dataset_images: Annotated[int, Field(ge=1, le=10**13)] | None = None
    overlap_comm: bool = True
    reduce_bucket_size: Elements | None = None
    allgather_bucket_size: Elements | None = None
    lr: Annotated[float, Field(gt=0, le=1.0)] = 1e-4
    input: ProfileInputIn | None = None
    """The node's input measured; without it the plan is not bounded by its input."""

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if value.lower() not in TARGET_GPUS:
            raise ValueError(f"unknown device {value!r}; one of {', '.join(TARGET_GPUS)}")
        return value.lower()

    @model_validator(mode="after")
    def _a_model(self) -> ProfileFileIn:
        if self.model is None and self.parameters is None:
            raise ValueError(
                f"give `model:` (a diffusers folder or {', '.join(MODEL_SHAPES)}) or `parameters: N`"
            )
        return self


class MetricsStepIn(BaseModel):
    """What a replan reads of one metrics.jsonl line (the trainer writes more: the rest is not read)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, frozen=True)

    step_time_s: StepSeconds
    peak_mem_bytes: Annotated[float, Field(ge=0, le=1e15)] | None = None
    micro_batch: Count | None = None
    grad_accum: Count | None = None


class RunConfigIn(BaseModel):
    """What a replan reads of run_config.json (the trainer's whole option tree: the rest is not read)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, frozen=True)

    model: str = ""
    world_size: Annotated[int, Field(ge=1, le=1_000_000)] = 1
    target_gpu: str | None = None


class ZeroIn(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, frozen=True)

    stage: Literal[0, 1, 2, 3] = 0


class OptimizerParamsIn(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, frozen=True)

    lr: Annotated[float, Field(gt=0, le=1.0)] | None = None


class OptimizerIn(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, frozen=True)

    params: OptimizerParamsIn = OptimizerParamsIn()


class EnabledIn(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    enabled: bool = False


class RunDsConfigIn(BaseModel):
    """What a replan reads of a run's effective ds_config.json (DeepSpeed checked the rest when it ran)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, frozen=True)

    train_micro_batch_size_per_gpu: Count
    gradient_accumulation_steps: Count = 1
    zero_optimization: ZeroIn = ZeroIn()
    optimizer: OptimizerIn | None = None
    bf16: EnabledIn | None = None
    fp16: EnabledIn | None = None


def check(schema: type[BaseModel], value: Any, where: str) -> Any:
    """`value` validated by `schema`, or one UserError: the first problem, its key and what it got."""
    if isinstance(value, dict) and any(not isinstance(k, str) for k in value):
        bad = next(k for k in value if not isinstance(k, str))
        raise UserError(
            f"{where}: key {bad!r} is not a name; keys are words such as {next(iter(schema.model_fields))}"
        )
    try:
        return schema.model_validate(value)
    except ValidationError as exc:
        raise UserError(f"{where}: {describe(exc, schema)}") from None
    except RecursionError:  # validated structures are bounded before (MAX_DEPTH); a guard all the same
        raise UserError(f"{where}: nested too deep") from None


def describe(exc: ValidationError, schema: type[BaseModel]) -> str:
    """The first error of `exc` in words: `configs[0].step_time_s: must be >= 0.0001 (got 0)`, or for an
    unknown key the closest known one."""
    error = exc.errors(include_url=False)[0]
    loc = error["loc"]
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    if error["type"] == "extra_forbidden":
        known = _known_keys(schema, loc[:-1])
        close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
        hint = f": did you mean {close[0]}?" if close else f"; known keys: {', '.join(known)}"
        parent = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[:-1]).lstrip(".")
        return f"{parent + ': ' if parent else ''}unknown key {str(loc[-1])[:60]}{hint}"
    got = _short(error.get("input"))
    message = str(error["msg"]).replace("Value error, ", "").replace("Input should be", "must be")
    return f"{path or 'the file'}: {message} (got {got})" if path else f"{message} (got {got})"


def _known_keys(schema: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The keys the schema knows at `loc` (a nested model's: the configs' for `configs[i]`)."""
    model: Any = schema
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part)
        annotation = getattr(field, "annotation", None)
        args = getattr(annotation, "__args__", ())
        model = next(
            (a for a in (annotation, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None
        )
    return list(model.model_fields) if model is not None else []


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


class YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with YAML 1.2's floats: `1e-308` is a number, not the string "1e-308"."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)$"),
    list("-+0123456789"),
)


def load_yaml_bounded(text: str, where: str) -> Any:
    """YAML (or JSON, a subset) parsed safely: plain data only, nested at most MAX_DEPTH deep, and at most
    MAX_YAML_NODES nodes once aliases are expanded. Anything else is one UserError starting with `where`."""
    try:
        depth = 0
        for event in yaml.parse(text, Loader=YamlLoader):  # events: no recursion, no construction
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                depth += 1
                if depth > MAX_DEPTH:
                    raise UserError(
                        f"{where}: nested deeper than {MAX_DEPTH} levels; a profile is a few levels deep"
                    )
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                depth -= 1
        loader = YamlLoader(text)
        try:
            node = loader.get_single_node()
            if node is None:
                return None
            if _expanded_nodes(node, {}) > MAX_YAML_NODES:
                raise UserError(
                    f"{where}: its aliases expand to more than {MAX_YAML_NODES:,} values (an alias bomb?)"
                )
            return loader.construct_document(node)
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise UserError(f"{where}: unreadable as YAML or JSON ({str(exc).splitlines()[0]})") from None
    except (ValueError, TypeError, OverflowError) as exc:  # a constructor's (a date out of range, ...)
        raise UserError(f"{where}: unreadable as YAML or JSON ({exc})") from None


def _expanded_nodes(node: yaml.Node, memo: dict[int, int]) -> int:
    """Nodes of `node` with every alias expanded, counted once per distinct node (memo): linear in the file,
    capped so the count stays small. Recursion is bounded by the depth check before it."""
    key = id(node)
    if key in memo:
        return memo[key]
    memo[key] = MAX_YAML_NODES + 1  # a node that holds itself (a recursive alias) counts as too many
    total = 1
    if isinstance(node, yaml.SequenceNode):
        total += sum(_expanded_nodes(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        total += sum(_expanded_nodes(k, memo) + _expanded_nodes(v, memo) for k, v in node.value)
    memo[key] = min(total, MAX_YAML_NODES + 1)
    return memo[key]
