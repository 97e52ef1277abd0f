"""Write a Hugging Face model folder holding only the first k decoder layers of another.

That is a small same-tokenizer draft model made without network access, and, loaded with
transformers, the reference a self-draft export (``export_draft(layers=k)``) is tested against.

    python -m pipeshard.exporter.truncate models/smollm2-135m-instruct /tmp/smollm2-2l --layers 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

from pipeshard.errors import InvalidArgument
from pipeshard.exporter.export import TOKENIZER_FILES
from pipeshard.exporter.families import cut_config, load_config, resolve_spec
from pipeshard.exporter.weights import SINGLE_FILE, weight_files


def truncate_model(model_dir: Path | str, out_dir: Path | str, layers: int) -> Path:
    """Copy ``model_dir`` to ``out_dir`` keeping decoder layers [0, layers) (config, weights in one
    safetensors file, tokenizer files); written to a hidden sibling and renamed at the end."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    config = load_config(model_dir)
    spec = resolve_spec(config)
    if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers < spec.num_layers:
        raise InvalidArgument("layers", f"must be an integer in [1, {spec.num_layers - 1}], got {layers!r}")
    dropped = tuple(spec.family.layer_prefix.format(i=i) for i in range(layers, spec.num_layers))
    tensors = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            names = f.keys()  # safe_open is not iterable itself
            tensors.update({name: f.get_tensor(name) for name in names if not name.startswith(dropped)})

    tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, str(tmp / SINGLE_FILE), metadata={"format": "pt"})
        for name in TOKENIZER_FILES:
            if name != "config.json" and (model_dir / name).is_file():
                shutil.copy2(model_dir / name, tmp / name)
        (tmp / "config.json").write_text(json.dumps(cut_config(config, layers), indent=2) + "\n")
        tmp.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeshard.exporter.truncate", description=__doc__)
    parser.add_argument("model", type=Path, help="Hugging Face model folder")
    parser.add_argument("out", type=Path, help="output folder (must not exist)")
    parser.add_argument("--layers", type=int, required=True, help="decoder layers to keep")
    args = parser.parse_args(argv)
    print(truncate_model(args.model, args.out, args.layers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
