"""EndpointPickerConfig: the Gateway API Inference Extension's scheduler configuration.

A config lists plugins (`name`, `type`, `parameters`) and scheduling profiles that
reference them (`pluginRef`, `weight`). Configs written for the Inference Extension
(`inference.networking.x-k8s.io`) or llm-d's router (`llm-d.ai/v1alpha1`, with its
`dataLayer`, `parser` and `requestHandler` sections) load unchanged; smart-epp's own
plugins use the same shape. Every problem found is reported at once, each with its field
path and its line/column in the YAML source.

Nothing is silently ignored: a field is honoured, or refused with the reason. Upstream
parameters that smart-epp satisfies by design are accepted and listed in
`LoadedConfig.notes` (logged when `epp serve` starts). The `flowControl` and
`saturationDetector` sections belong to the flow-control layer.

Plugin types come from the framework's registry; importing the scorers' catalog here
registers every built-in type before any config is read.
"""

from __future__ import annotations

import importlib.resources
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..framework.plugins import Filter, Picker, Plugin, ProfileHandler, Scorer
from ..framework.registry import registered_plugins
from ..scorers import catalog  # noqa: F401  (registers the built-in plugins)
from .flowcontrol.settings import (
    DETECTOR_TYPES,
    FLOW_CONTROL_GATE,
    FlowControlSpec,
    SaturationDetectorRef,
    gate_enabled,
)
from .upstream_plugins import FEATURE_GATES, NOT_IMPLEMENTED

API_VERSIONS = (
    "inference.networking.x-k8s.io/v1alpha1",
    "inference.networking.k8s.io/v1alpha1",
    "llm-d.ai/v1alpha1",
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


class PluginRef(_Strict):
    pluginRef: str = Field(min_length=1)


class DataLayerSource(_Strict):
    pluginRef: str = Field(min_length=1)
    extractors: list[PluginRef] = Field(default_factory=list)


class DataLayerConfig(_Strict):
    """llm-d's data layer: which sources feed the datastore and what is read from them."""

    injectDefaults: bool | None = None
    sources: list[DataLayerSource] = Field(default_factory=list)
    discovery: PluginRef | None = None
    peerDiscovery: PluginRef | None = None
    crossReplicaSyncerPluginRef: str | None = None
    crossReplicaSyncInterval: str | None = None


class RequestHandlerConfig(_Strict):
    parsers: list[PluginRef] = Field(default_factory=list)


class EndpointPickerConfig(_Strict):
    apiVersion: Literal[API_VERSIONS] = API_VERSIONS[0]  # type: ignore[valid-type]
    kind: Literal["EndpointPickerConfig"] = "EndpointPickerConfig"
    plugins: list[PluginSpec] = Field(min_length=1)
    schedulingProfiles: list[SchedulingProfile] = Field(default_factory=list)
    # "flowControl" turns flow control on, as in llm-d; other gates are checked.
    featureGates: list[str] | None = None
    flowControl: FlowControlSpec | None = None
    # The older top-level form (a pluginRef, or the Inference Extension's inline thresholds).
    saturationDetector: SaturationDetectorRef | None = None
    dataLayer: DataLayerConfig | None = None
    data: DataLayerConfig | None = None  # the Inference Extension's earlier name
    parser: PluginRef | None = None  # deprecated upstream for requestHandler.parsers
    requestHandler: RequestHandlerConfig | None = None


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
    # ref -> the type actually built, where it differs from the configured one (an
    # llm-d prefix-cache-scorer fed by a precise producer becomes the precise scorer).
    built_types: dict[str, str] = field(default_factory=dict)
    # Upstream settings accepted because smart-epp satisfies them by design, with why.
    notes: list[str] = field(default_factory=list)


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
            reason = NOT_IMPLEMENTED.get(spec.type)
            if reason is not None:
                message = (
                    f"plugin type {spec.type!r} is known upstream but not implemented in "
                    f"smart-epp: {reason}"
                )
            else:
                known = ", ".join(sorted(registry))
                message = f"unknown plugin type {spec.type!r}; known: {known}"
            issues.append((("plugins", i, "type"), message))
            continue
        try:
            params = cls.Params.model_validate(spec.parameters or {})
        except ValidationError as exc:
            for err in exc.errors():
                issues.append((("plugins", i, "parameters", *err["loc"]), err["msg"]))
            continue
        for path, message in check_parameters(spec, params):
            if message.startswith(NOTE_PREFIX):
                loaded.notes.append(
                    f"plugins[{i}] ({spec.ref}).{path}: {message[len(NOTE_PREFIX) :]}"
                )
            else:
                issues.append((("plugins", i, "parameters", *path.split(".")), message))
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
    kinds = {
        spec.ref: cls.kind
        for spec in config.plugins
        if (cls := registry.get(spec.type)) is not None
    }
    issues.extend(_check_profile_handler(config, registry))
    issues.extend(_check_sections(config, kinds))
    issues.extend(_check_feature_gates(config.featureGates or []))
    issues.extend(_resolve_producers(config, loaded))
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
        (
            ("flowControl", "saturationDetector", "pluginRef"),
            spec.saturationDetector if spec is not None else None,
        ),
        (("saturationDetector", "pluginRef"), config.saturationDetector),
    ):
        if ref is None or ref.pluginRef is None:
            continue
        if ref.pluginRef not in refs:
            issues.append((loc, f"no plugin named {ref.pluginRef!r} in plugins"))
        elif config.plugins[refs[ref.pluginRef]].type not in DETECTOR_TYPES:
            issues.append((loc, f"{ref.pluginRef!r} is not one of {', '.join(DETECTOR_TYPES)}"))
    if spec is not None and not gate_enabled(config.featureGates, FLOW_CONTROL_GATE):
        loaded.notes.append(
            "flowControl is set but the flowControl feature gate is off: only its "
            "saturationDetector is used (add featureGates: [flowControl] to turn it on)"
        )
    if spec is not None and spec.usageLimitPolicyPluginRef:
        loaded.notes.append("flowControl.usageLimitPolicyPluginRef is not used by smart-epp")
    if spec is not None and spec.enableEviction:
        loaded.notes.append("flowControl.enableEviction is not used by smart-epp")


# --------------------------------------------------------------------------- field checks

NOTE_PREFIX = "note: "


def check_parameters(spec: PluginSpec, params: Any) -> list[tuple[str, str]]:
    """Parameters the plugin does not declare: a note when upstream defines them and
    smart-epp satisfies them by design, else an error. Returns (dotted path, message)."""
    notes: Mapping[str, str] = type(params).upstream_notes
    out: list[tuple[str, str]] = []

    def judge(path: str) -> None:
        reason = _note_for(notes, path)
        if reason is not None:
            out.append((path, NOTE_PREFIX + reason))
        else:
            out.append((path, f"not a parameter of {spec.type} in smart-epp"))

    for key in sorted((params.model_extra or {}).keys()):
        judge(key)
    for key in sorted(type(params).nested_parameters):
        raw = (spec.parameters or {}).get(key)
        if not isinstance(raw, dict):
            continue
        declared = type(params).model_fields[key].annotation
        for path in _leaf_paths(raw, key):
            if _declared_leaf(declared, path):
                continue
            judge(path)
    return out


def _leaf_paths(value: Mapping[str, Any], prefix: str) -> list[str]:
    out: list[str] = []
    for k, v in value.items():
        path = f"{prefix}.{k}"
        if isinstance(v, dict) and v:
            out.extend(_leaf_paths(v, path))
        else:
            out.append(path)
    return out


def _declared_leaf(annotation: Any, path: str) -> bool:
    """True when a typed sub-model declares this leaf (it is then validated, not noted)."""
    fields = getattr(annotation, "model_fields", None)
    if fields is None:
        for arg in getattr(annotation, "__args__", ()):
            if getattr(arg, "model_fields", None) is not None:
                fields = arg.model_fields
                break
    if fields is None:
        return False
    return path.split(".", 1)[1] in fields


def _note_for(notes: Mapping[str, str], path: str) -> str | None:
    if path in notes:
        return notes[path]
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        wildcard = ".".join(parts[:cut]) + ".*"
        if wildcard in notes:
            return notes[wildcard]
    return None


def _check_profile_handler(
    config: EndpointPickerConfig, registry: Mapping[str, type[Plugin]]
) -> list[tuple[Loc, str]]:
    handlers = [
        (i, spec)
        for i, spec in enumerate(config.plugins)
        if (cls := registry.get(spec.type)) is not None and issubclass(cls, ProfileHandler)
    ]
    issues: list[tuple[Loc, str]] = []
    for i, _spec in handlers[1:]:
        issues.append((("plugins", i, "type"), "at most one profile handler per config"))
    count = len(config.schedulingProfiles)
    if handlers:
        i, spec = handlers[0]
        cls = registry[spec.type]
        limit = cls.max_profiles  # type: ignore[attr-defined]
        if count > limit:
            issues.append(
                (
                    ("schedulingProfiles",),
                    f"{spec.type} runs exactly {limit} profile per request; this config has "
                    f"{count} (multi-profile handlers such as disagg-profile-handler are "
                    "not implemented)",
                )
            )
    elif count > 1 and not any(spec.type.endswith("profile-handler") for spec in config.plugins):
        # (an unimplemented handler was already reported as such)
        issues.append(
            (
                ("schedulingProfiles",),
                f"{count} profiles but no profile handler to choose between them; smart-epp "
                "runs one profile per request (single-profile-handler)",
            )
        )
    return issues


_SOURCE_KINDS = ("data-source",)
_EXTRACTOR_KINDS = ("extractor", "producer")


def _check_sections(
    config: EndpointPickerConfig, kinds: Mapping[str, str]
) -> list[tuple[Loc, str]]:
    issues: list[tuple[Loc, str]] = []

    def expect(loc: Loc, ref: str, wanted: tuple[str, ...], what: str) -> None:
        kind = kinds.get(ref)
        if kind is None:
            if ref not in {spec.ref for spec in config.plugins}:
                issues.append((loc, f"no plugin named {ref!r} in plugins"))
        elif kind not in wanted:
            issues.append((loc, f"{ref!r} is a {kind}, not a {what}"))

    for section in ("dataLayer", "data"):
        layer: DataLayerConfig | None = getattr(config, section)
        if layer is None:
            continue
        if layer.injectDefaults is False:
            issues.append(
                (
                    (section, "injectDefaults"),
                    "smart-epp always scrapes each endpoint's /metrics; it cannot be turned off",
                )
            )
        for s_i, src in enumerate(layer.sources):
            expect(
                (section, "sources", s_i, "pluginRef"), src.pluginRef, _SOURCE_KINDS, "data source"
            )
            for e_i, ext in enumerate(src.extractors):
                loc: Loc = (section, "sources", s_i, "extractors", e_i, "pluginRef")
                expect(loc, ext.pluginRef, _EXTRACTOR_KINDS, "extractor")
        for name, why in (
            ("discovery", "endpoints come from --endpoints-file, --endpoint or --pool-name"),
            ("peerDiscovery", "replicas share state through Redis, not peer discovery"),
            ("crossReplicaSyncerPluginRef", "replicas share the KV index through Redis"),
            ("crossReplicaSyncInterval", "replicas share the KV index through Redis"),
        ):
            if getattr(layer, name) is not None:
                issues.append(((section, name), f"not implemented in smart-epp: {why}"))
    if config.parser is not None:
        expect(("parser", "pluginRef"), config.parser.pluginRef, ("parser",), "parser")
    if config.requestHandler is not None:
        for p_i, ref in enumerate(config.requestHandler.parsers):
            expect(
                ("requestHandler", "parsers", p_i, "pluginRef"),
                ref.pluginRef,
                ("parser",),
                "parser",
            )
    return issues


def _check_feature_gates(gates: Sequence[str]) -> list[tuple[Loc, str]]:
    issues: list[tuple[Loc, str]] = []
    for g_i, gate in enumerate(gates):
        name, _, value = gate.partition("=")
        name = name.strip()
        value = value.strip().lower() or "true"
        loc: Loc = ("featureGates", g_i)
        if name not in FEATURE_GATES:
            known = ", ".join(sorted(FEATURE_GATES))
            issues.append((loc, f"unknown feature gate {name!r}; known: {known}"))
        elif value not in ("true", "false"):
            issues.append((loc, f"a gate is `name`, `name=true` or `name=false`, not {gate!r}"))
        elif value == "false" and name != "flowControl":
            issues.append((loc, f"{name} cannot be turned off in smart-epp: {FEATURE_GATES[name]}"))
    return issues


PRECISE_PRODUCER = "precise-prefix-cache-producer"
APPROX_PRODUCER = "approx-prefix-cache-producer"


def _resolve_producers(config: EndpointPickerConfig, loaded: LoadedConfig) -> list[tuple[Loc, str]]:
    """Builds each llm-d `prefix-cache-scorer` as the scorer its producer implies."""
    issues: list[tuple[Loc, str]] = []
    by_ref = {spec.ref: spec for spec in config.plugins}
    approx = [spec for spec in config.plugins if spec.type == APPROX_PRODUCER]
    for i, spec in enumerate(config.plugins):
        if spec.type != "prefix-cache-scorer" or spec.ref not in loaded.plugin_params:
            continue
        params = loaded.plugin_params[spec.ref]
        producer_name = params.prefixMatchInfoProducerName
        producer = by_ref.get(producer_name) if producer_name else (approx[0] if approx else None)
        if producer_name and producer is None:
            issues.append(
                (
                    ("plugins", i, "parameters", "prefixMatchInfoProducerName"),
                    f"no plugin named {producer_name!r} in plugins",
                )
            )
            continue
        if producer is None or producer.ref not in loaded.plugin_params:
            continue
        producer_params = loaded.plugin_params[producer.ref]
        if producer.type == PRECISE_PRODUCER:
            registry = plugin_types()
            precise = registry["precise-prefix-cache-scorer"].Params
            size = producer_params.block_size()
            loaded.plugin_params[spec.ref] = precise.model_validate(
                {"blockSize": size} if size else {}
            )
            loaded.built_types[spec.ref] = "precise-prefix-cache-scorer"
        elif producer.type == APPROX_PRODUCER:
            merged = {**producer_params.scorer_parameters(), **(spec.parameters or {})}
            merged.pop("prefixMatchInfoProducerName", None)
            loaded.plugin_params[spec.ref] = type(params).model_validate(merged)
        else:
            issues.append(
                (
                    ("plugins", i, "parameters", "prefixMatchInfoProducerName"),
                    f"{producer_name!r} is a {producer.type}, not a prefix-match producer",
                )
            )
    return issues


def _error(source: str, root: yaml.Node | None, issues: list[tuple[Loc, str]]) -> ConfigError:
    out = []
    for loc, msg in issues:
        line, col = _locate(root, loc)
        out.append(ConfigIssue(_format_loc(loc), msg, line, col))
    return ConfigError(source, out)


def load_config_file(path: str | Path) -> LoadedConfig:
    path = Path(path)
    return parse_config(path.read_text(encoding="utf-8"), source=str(path))


def builtin_config_text(name: str) -> str:
    """The YAML of one of the configs shipped with smart-epp (BUILTIN_CONFIGS)."""
    if name not in BUILTIN_CONFIGS:
        raise ValueError(f"no built-in config {name!r}; choose one of {', '.join(BUILTIN_CONFIGS)}")
    return importlib.resources.files("smart_epp.epp.configs").joinpath(f"{name}.yaml").read_text()


def builtin_config(name: str) -> LoadedConfig:
    """One of the configs shipped with smart-epp (BUILTIN_CONFIGS)."""
    return parse_config(builtin_config_text(name), source=f"built-in {name!r}")


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
    handler: ProfileHandler | None = None

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
        cls = registry[loaded.built_types.get(spec.ref, spec.type)]
        instances[spec.ref] = cls(spec.ref, loaded.plugin_params[spec.ref])
    handler = next((p for p in instances.values() if isinstance(p, ProfileHandler)), None)

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
    for profile in profile_specs:
        filters: list[Filter] = []
        scorers: list[tuple[Scorer, float]] = []
        picker: Picker | None = None
        for ref in profile.plugins:
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
        profiles.append(Profile(profile.name, filters, scorers, picker))  # type: ignore[arg-type]
    return PluginSet(instances, profiles, handler)
