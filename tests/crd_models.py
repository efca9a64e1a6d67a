"""Strict validation of the chart's custom resources against the Python models their
projects publish: KServe's objects with the `kserve` package's OpenAPI models (Kubernetes'
own models for the core types inside them), KEDA's with `cloudcoil-models-keda` (pydantic
models generated from KEDA's CRD schemas). Unknown fields, wrong types and missing required
fields are errors naming the path; neither library rejects an unknown field by itself.

    python -m tests.crd_models OBJECTS.yaml     one line per document: "ok KIND" or
                                                "error KIND: what is wrong"

Run it as a process of its own: `import kserve` loads KServe's copy of the v2 inference
protos, which clashes with tritonclient's (the same `inference.*` names) in one interpreter.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

# OpenAPI primitive type names of the kserve/kubernetes models -> accepted JSON types.
# Quantities and int-or-string fields are typed 'str' or 'object' there: numbers pass as str.
_PRIMITIVES: dict[str, tuple[type, ...]] = {
    "str": (str, int, float), "int": (int,), "float": (int, float), "bool": (bool,),
    "object": (object,), "datetime": (str,), "date": (str,), "bytes": (str,),
    "ResourceQuantity": (str, int, float)}

KSERVE_TYPES = {"ServingRuntime": "V1alpha1ServingRuntime",
                "InferenceService": "V1beta1InferenceService"}


class ModelError(ValueError):
    """A field of a rendered object that its project's models do not accept."""


def _model_class(name: str):
    import kserve.models
    import kubernetes.client.models
    for module in (kserve.models, kubernetes.client.models):
        if hasattr(module, name):
            return getattr(module, name)
    raise ModelError(f"no kserve or kubernetes model named {name}")


def _build(value: Any, type_name: str, path: str) -> Any:
    """JSON `value` of OpenAPI type `type_name` -> the model object; ModelError otherwise."""
    # containers: list[T] / List[T], dict(str, T) / Dict[str, T] (two generators' spellings)
    if type_name.lower().startswith("list["):
        if not isinstance(value, list):
            raise ModelError(f"{path}: expected a list, got {type(value).__name__}")
        return [_build(v, type_name[5:-1], f"{path}[{i}]") for i, v in enumerate(value)]
    if type_name.startswith(("dict(", "Dict[")):
        if not isinstance(value, dict):
            raise ModelError(f"{path}: expected a mapping, got {type(value).__name__}")
        inner = type_name[5:-1].split(", ", 1)[1]
        return {k: _build(v, inner, f"{path}.{k}") for k, v in value.items()}
    if type_name in _PRIMITIVES:
        ok = isinstance(value, _PRIMITIVES[type_name])
        if not ok or (isinstance(value, bool) and type_name in ("int", "float", "str")):
            raise ModelError(f"{path}: expected {type_name}, got {value!r}")
        return value
    cls = _model_class(type_name)
    if not isinstance(value, dict):
        raise ModelError(f"{path}: expected a {type_name} mapping, got {value!r}")
    by_json = {json_name: attr for attr, json_name in cls.attribute_map.items()}
    unknown = sorted(set(value) - set(by_json))
    if unknown:
        raise ModelError(f"{path}: unknown field(s) {unknown} for {type_name}")
    kwargs = {by_json[k]: _build(v, cls.openapi_types[by_json[k]], f"{path}.{k}")
              for k, v in value.items()}
    try:       # the models check required fields and enums as they are built
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ModelError(f"{path} ({type_name}): {e}") from None


def validate_kserve(obj: dict) -> Any:
    """A rendered ServingRuntime or InferenceService -> its kserve model; ModelError."""
    group, _, version = obj.get("apiVersion", "").partition("/")
    type_name = KSERVE_TYPES.get(obj.get("kind", ""))
    if group != "serving.kserve.io" or type_name is None or \
            not type_name.lower().startswith(version):
        raise ModelError(f"not a KServe object kserve's models know: {obj.get('apiVersion')} "
                         f"{obj.get('kind')}")
    return _build(obj, type_name, obj["kind"])


def validate_keda(obj: dict) -> Any:
    """A rendered KEDA ScaledObject -> its cloudcoil model; ModelError on a field the CRD
    schema does not have (the model ignores those: its dump must give the object back)."""
    from cloudcoil.models.keda import v1alpha1
    if (obj.get("apiVersion"), obj.get("kind")) != ("keda.sh/v1alpha1", "ScaledObject"):
        raise ModelError(f"not a KEDA ScaledObject: {obj.get('apiVersion')} {obj.get('kind')}")
    try:
        model = v1alpha1.ScaledObject.model_validate(obj)
    except ValueError as e:      # pydantic's ValidationError
        raise ModelError(f"ScaledObject: {e}") from None
    back = model.model_dump(mode="json", by_alias=True, exclude_unset=True)
    _same(obj, back, "ScaledObject")
    return model


def _same(given: Any, back: Any, path: str) -> None:
    """ModelError at the first place where the model's dump differs from the object."""
    if isinstance(given, dict) and isinstance(back, dict):
        for k in sorted(set(given) | set(back)):
            if k not in back:
                raise ModelError(f"{path}.{k}: not a field of the CRD schema")
            if k not in given:
                raise ModelError(f"{path}.{k}: added by the model")
            _same(given[k], back[k], f"{path}.{k}")
    elif isinstance(given, list) and isinstance(back, list) and len(given) == len(back):
        for i, (a, b) in enumerate(zip(given, back)):
            _same(a, b, f"{path}[{i}]")
    elif given != back:
        raise ModelError(f"{path}: {given!r} reads back as {back!r}")


def main(argv: list[str]) -> int:
    import yaml
    for doc in yaml.safe_load_all(Path(argv[0]).read_text()):
        check = validate_keda if doc.get("apiVersion", "").startswith("keda.sh/") \
            else validate_kserve
        try:
            check(doc)
            print(f"ok {doc.get('kind')}")
        except ModelError as e:
            print(f"error {doc.get('kind')}: " + str(e).replace("\n", " "))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
