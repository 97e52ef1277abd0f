"""The compiled-model cache (pipeshard/shard/compile_cache.py): a first compile fills the export's
folder for its device, the next one loads from it, and a folder that cannot be written only
turns the cache off."""

from __future__ import annotations

import numpy as np

from pipeshard.shard.compile_cache import FOLDER, cache_folder
from pipeshard.shard.manifest import load_manifest
from pipeshard.shard.runtime import ShardRunner


def _logits(runner: ShardRunner) -> np.ndarray:
    return runner.new_session().run(np.array([[1, 2, 3]], dtype=np.int64))


def test_first_compile_fills_the_cache_and_the_next_loads_it(tiny_export, tmp_path):
    export = tiny_export("llama", 1)
    root = tmp_path / "cache"
    first = ShardRunner(export, 0, compile_cache=root)
    folder = cache_folder(root, load_manifest(export), "CPU")
    blobs = sorted(folder.glob("*.blob"))
    assert len(blobs) == 1 and not first.compiled.get_property("LOADED_FROM_CACHE")
    second = ShardRunner(export, 0, compile_cache=root, precision="f32", num_threads=1)
    assert second.compiled.get_property("LOADED_FROM_CACHE")
    assert sorted(folder.glob("*.blob")) == blobs  # precision and threads are applied at load, one blob
    assert second.compiled_properties()["INFERENCE_NUM_THREADS"] == "1"
    uncached = ShardRunner(export, 0, precision="f32", num_threads=1)
    np.testing.assert_array_equal(_logits(second), _logits(uncached))


def test_default_folder_is_inside_the_export_and_off_is_off(tiny_export):
    manifest = load_manifest(tiny_export("llama", 1))
    assert cache_folder("", manifest, "AUTO:GPU,CPU") == manifest.export_dir / FOLDER / "AUTO_GPU_CPU"
    assert cache_folder("off", manifest, "CPU") is None
    assert not ShardRunner(manifest.export_dir, 0).compiled.get_property("LOADED_FROM_CACHE")


def test_an_unwritable_cache_folder_only_turns_caching_off(tiny_export, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder's parent should be")
    runner = ShardRunner(tiny_export("llama", 1), 0, compile_cache=blocker / "cache")
    assert _logits(runner).shape[-1] > 0 and not runner.compiled.get_property("LOADED_FROM_CACHE")
    assert blocker.is_file()
