"""EndpointPickerConfig: the Gateway API Inference Extension's scheduler configuration.

A config lists plugins (`name`, `type`, `parameters`) and scheduling profiles that
reference them (`pluginRef`, `weight`). Configs written for the Inference Extension or
llm-d load unchanged; smart-epp's own plugins use the same shape. Every problem found is
reported at once, each with its field path and its line/column in the YAML source.

Plugin types come from the framework's registry; importing the scorers' catalog here
registers every built-in type before any config is read.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..framework.plugins import Filter, Picker, Plugin, Scorer
from ..framework.registry import registered_plugins
from ..scorers import catalog  # noqa: F401  (registers the built-in plugins)
from .flowcontrol.settings import (
    DETECTOR_TYPES,
    FLOW_CONTROL_GATE,
    FlowControlSpec,
    SaturationDetectorRef,
    gate_enabled,
)

API_VERSIONS = (
    "inference.networking.x-k8s.io/v1alpha1",
    "inference.networking.k8s.io/v1alpha1",
)
BUILTIN_CONFIGS = ("default", "gie-default", "llmd-precise", "default-flow-control")
DEFAULT_PICKER = "max-score-picker"

# --------------------------------------------------------------------------- registry


def plugin_types() -> dict[str, type[Plugin]]:
    """Every registered plugin type: the built-in catalog and any plugin imported since."""
    return registered_plugins()


# --------------------------------------------------------------------------- the schema


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PluginSpec(_Strict):
    type: str = Field(min_length=1)
    name: str | None = None  # defaults to the type, as in the Inference Extension
    parameters: dict[str, Any] | None = None

    @property
    def ref(self) -> str:
        return self.name or self.type


class ProfilePluginRef(_Strict):
    pluginRef: str = Field(min_length=1)
    weight: float | None = Field(default=None, ge=0)


class SchedulingProfile(_Strict):
    name: str = Field(min_length=1)
    plugins: list[ProfilePluginRef] = Field(default_factory=list)


class EndpointPickerConfig(_Strict):
    apiVersion: Literal[API_VERSIONS] = API_VERSIONS[0]  # type: ignore[valid-type]
    kind: Literal["EndpointPickerConfig"] = "EndpointPickerConfig"
    plugins: list[PluginSpec] = Field(min_length=1)
    schedulingProfiles: list[SchedulingProfile] = Field(default_factory=list)
    # "flowControl" turns flow control on, as in llm-d; other gates are accepted.
    featureGates: list[str] | None = None
    flowControl: FlowControlSpec | None = None
    # The older top-level form (a pluginRef, or the Inference Extension's inline thresholds).
    saturationDetector: SaturationDetectorRef | None = None
    # Accepted for compatibility; smart-epp configures these elsewhere.
    data: dict[str, Any] | None = None


# --------------------------------------------------------------------------- errors


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    path: str  # e.g. "plugins[1].parameters.threshold"
    message: str
    line: int | None = None  # 1-based, in the YAML source
    column: int | None = None

    def __str__(self) -> str:
        where = f" (line {self.line}, column {self.column})" if self.line is not None else ""
        return f"{self.path or '<root>'}: {self.message}{where}"


class ConfigError(ValueError):
    """An invalid EndpointPickerConfig; `issues` lists every problem with its position."""

    def __init__(self, source: str, issues: Sequence[ConfigIssue]) -> None:
        self.source = source
        self.issues = list(issues)
        lines = "\n".join(f"  {issue}" for issue in self.issues)
        super().__init__(f"invalid EndpointPickerConfig {source}:\n{lines}")


Loc = tuple[str | int, ...]


def _format_loc(loc: Loc) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _locate(root: yaml.Node | None, loc: Loc) -> tuple[int | None, int | None]:
    """Line/column of the deepest YAML node along `loc` (1-based)."""
    node = root
    for part in loc:
        child: yaml.Node | None = None
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                if key_node.value == part:
                    child = value_node
                    break
        elif (
            isinstance(node, yaml.SequenceNode)
            and isinstance(part, int)
            and 0 <= part < len(node.value)
        ):
            child = node.value[part]
        if child is None:
            break
        node = child
    if node is None:
        return None, None
    return node.start_mark.line + 1, node.start_mark.column + 1


# --------------------------------------------------------------------------- loading


@dataclass(slots=True)
class LoadedConfig:
    """A validated config plus the typed parameters of every plugin."""

    config: EndpointPickerConfig
    source: str
    plugin_params: dict[str, Any] = field(default_factory=dict)  # ref -> Params instance
    warnings: list[str] = field(default_factory=list)


def parse_config(text: str, source: str = "<string>") -> LoadedConfig:
    """Parses and validates YAML text; raises ConfigError listing every problem."""
    try:
        root = yaml.compose(text)
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        col = mark.column + 1 if mark is not None else None
        raise ConfigError(source, [ConfigIssue("", f"not valid YAML: {exc}", line, col)]) from exc
    return validate_config(data, source, root)


def validate_config(
    data: Any, source: str = "<data>", root: yaml.Node | None = None
) -> LoadedConfig:
    issues: list[tuple[Loc, str]] = []
    if not isinstance(data, dict):
        raise ConfigError(source, [ConfigIssue("", "expected a mapping at the top level", 1, 1)])
    try:
        config = EndpointPickerConfig.model_validate(data)
    except ValidationError as exc:
        for err in exc.errors():
            issues.append((tuple(err["loc"]), err["msg"]))
        raise _error(source, root, issues) from exc

    registry = plugin_types()
    loaded = LoadedConfig(config=config, source=source)
    refs: dict[str, int] = {}
    for i, spec in enumerate(config.plugins):
        if spec.ref in refs:
            issues.append(((("plugins", i, "name")), f"duplicate plugin name {spec.ref!r}"))
            continue
        refs[spec.ref] = i
        cls = registry.get(spec.type)
        if cls is None:
            known = ", ".join(sorted(registry))
            issues.append(
                (("plugins", i, "type"), f"unknown plugin type {spec.type!r}; known: {known}")
            )
            continue
        try:
            params = cls.Params.model_validate(spec.parameters or {})
        except ValidationError as exc:
            for err in exc.errors():
                issues.append((("plugins", i, "parameters", *err["loc"]), err["msg"]))
            continue
        extra = sorted((params.model_extra or {}).keys())
        if extra:
            loaded.warnings.append(
                f"plugins[{i}] ({spec.ref}): parameters not used by smart-epp: {', '.join(extra)}"
            )
        loaded.plugin_params[spec.ref] = params

    for p, profile in enumerate(config.schedulingProfiles):
        pickers = 0
        for r, ref in enumerate(profile.plugins):
            loc: Loc = ("schedulingProfiles", p, "plugins", r, "pluginRef")
            if ref.pluginRef not in refs:
                issues.append((loc, f"no plugin named {ref.pluginRef!r} in plugins"))
                continue
            cls = registry.get(config.plugins[refs[ref.pluginRef]].type)
            if cls is not None and cls.kind == "picker":
                pickers += 1
        if pickers > 1:
            issues.append((("schedulingProfiles", p, "plugins"), "at most one picker per profile"))
    _check_flow_control(config, refs, loaded, issues)
    names = [profile.name for profile in config.schedulingProfiles]
    for p, name in enumerate(names):
        if names.index(name) != p:
            issues.append((("schedulingProfiles", p, "name"), f"duplicate profile name {name!r}"))
    if issues:
        raise _error(source, root, issues)
    return loaded


def _check_flow_control(
    config: EndpointPickerConfig,
    refs: dict[str, int],
    loaded: LoadedConfig,
    issues: list[tuple[Loc, str]],
) -> None:
    spec = config.flowControl
    for loc, ref in (
        (("flowControl", "saturationDetector", "pluginRef"), spec and spec.saturationDetector),
        (("saturationDetector", "pluginRef"), config.saturationDetector),
    ):
        if ref is None or ref.pluginRef is None:
            continue
        if ref.pluginRef not in refs:
            issues.append((loc, f"no plugin named {ref.pluginRef!r} in plugins"))
        elif config.plugins[refs[ref.pluginRef]].type not in DETECTOR_TYPES:
            issues.append((loc, f"{ref.pluginRef!r} is not one of {', '.join(DETECTOR_TYPES)}"))
    if spec is not None and not gate_enabled(config.featureGates, FLOW_CONTROL_GATE):
        loaded.warnings.append(
            "flowControl is set but the flowControl feature gate is off: only its "
            "saturationDetector is used (add featureGates: [flowControl] to turn it on)"
        )
    if spec is not None and spec.usageLimitPolicyPluginRef:
        loaded.warnings.append("flowControl.usageLimitPolicyPluginRef is not used by smart-epp")
    if spec is not None and spec.enableEviction:
        loaded.warnings.append("flowControl.enableEviction is not used by smart-epp")


def _error(source: str, root: yaml.Node | None, issues: list[tuple[Loc, str]]) -> ConfigError:
    out = []
    for loc, msg in issues:
        line, col = _locate(root, loc)
        out.append(ConfigIssue(_format_loc(loc), msg, line, col))
    return ConfigError(source, out)


def load_config_file(path: str | Path) -> LoadedConfig:
    path = Path(path)
    return parse_config(path.read_text(encoding="utf-8"), source=str(path))


def builtin_config(name: str) -> LoadedConfig:
    """One of the configs shipped with smart-epp (BUILTIN_CONFIGS)."""
    if name not in BUILTIN_CONFIGS:
        raise ValueError(f"no built-in config {name!r}; choose one of {', '.join(BUILTIN_CONFIGS)}")
    text = importlib.resources.files("smart_epp.epp.configs").joinpath(f"{name}.yaml").read_text()
    return parse_config(text, source=f"built-in {name!r}")


def load_config(spec: str | Path | LoadedConfig | None = None) -> LoadedConfig:
    """A built-in name, a YAML file path, or an already loaded config (None = default)."""
    if spec is None:
        return builtin_config("default")
    if isinstance(spec, LoadedConfig):
        return spec
    if isinstance(spec, str) and spec in BUILTIN_CONFIGS:
        return builtin_config(spec)
    return load_config_file(spec)


# --------------------------------------------------------------------------- instantiation


@dataclass(slots=True)
class Profile:
    """A scheduling profile with its plugins instantiated, in config order."""

    name: str
    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]
    picker: Picker


@dataclass(slots=True)
class PluginSet:
    plugins: dict[str, Plugin]  # by ref, every plugin in the config (one instance each)
    profiles: list[Profile]

    def of_type(self, type_name: str) -> list[Plugin]:
        return [p for p in self.plugins.values() if p.type_name == type_name]


def instantiate(loaded: LoadedConfig) -> PluginSet:
    """Creates one instance per configured plugin and wires the profiles.

    A profile without a picker gets a max-score-picker; a config without profiles gets one
    profile named "default" using every filter, scorer and picker in plugin order (weight 1),
    both as in the Inference Extension.
    """
    registry = plugin_types()
    instances: dict[str, Plugin] = {}
    for spec in loaded.config.plugins:
        cls = registry[spec.type]
        instances[spec.ref] = cls(spec.ref, loaded.plugin_params[spec.ref])

    profile_specs: Iterable[SchedulingProfile] = loaded.config.schedulingProfiles or [
        SchedulingProfile(
            name="default",
            plugins=[
                ProfilePluginRef(pluginRef=ref)
                for ref, plugin in instances.items()
                if plugin.kind in ("filter", "scorer", "picker")
            ],
        )
    ]
    profiles: list[Profile] = []
    for spec in profile_specs:
        filters: list[Filter] = []
        scorers: list[tuple[Scorer, float]] = []
        picker: Picker | None = None
        for ref in spec.plugins:
            plugin = instances[ref.pluginRef]
            if isinstance(plugin, Filter):
                filters.append(plugin)
            elif isinstance(plugin, Scorer):
                scorers.append((plugin, 1.0 if ref.weight is None else ref.weight))
            elif isinstance(plugin, Picker):
                picker = plugin
        if picker is None:
            cls = registry[DEFAULT_PICKER]
            picker = cls(DEFAULT_PICKER, cls.Params())  # type: ignore[assignment]
        profiles.append(Profile(spec.name, filters, scorers, picker))  # type: ignore[arg-type]
    return PluginSet(instances, profiles)
