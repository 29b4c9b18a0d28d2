"""Build data/pycode.bin and data/doc_lengths.json from the source files of Python's standard library.

Real code, real long-tailed document lengths, nothing downloaded: every Python
install ships these files. The committed artifacts make runs identical on every
machine whatever its Python version; rerun this script to rebuild them.

    python data/build_corpus.py            # ~2 MB of tokens, lengths of every stdlib module
"""
from __future__ import annotations

import json
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_BYTES = 2_000_000
EOD = 0  # byte 0 never occurs in source text: it marks the end of a document


def main() -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py")
                   if "site-packages" not in p.parts and "test" not in p.parts and "idlelib" not in p.parts)
    lengths, chunks, total = [], [], 0
    for path in files:
        data = path.read_bytes().replace(b"\x00", b"")
        if not data.isascii():
            data = data.decode("utf-8", "replace").encode("ascii", "replace")
        lengths.append(len(data))
        if total + len(data) + 1 <= MAX_BYTES:
            chunks.append(data + bytes([EOD]))
            total += len(data) + 1
    (HERE / "pycode.bin").write_bytes(b"".join(chunks))
    (HERE / "doc_lengths.json").write_text(json.dumps({
        "source": f"Python {sysconfig.get_python_version()} standard library (*.py, tests excluded)",
        "unit": "bytes (= tokens of the byte tokenizer)", "lengths": lengths}))
    print(f"{len(chunks)} documents, {total} bytes in pycode.bin; {len(lengths)} document lengths")


if __name__ == "__main__":
    main()
