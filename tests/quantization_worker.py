"""Run by tests/test_quantization.py in a Python that can import torchao (PYTHONPATH names the folder that
scripts/setup_env.sh installs it in): `python quantization_worker.py FOLDER QUANTIZER` runs the quantized-load checks
on the model saved in FOLDER and prints "checked QUANTIZER"; a failed check is a traceback and exit code 1."""

import sys

from test_quantization import check_quantized_load

if __name__ == "__main__":
    folder, quantizer = sys.argv[1:]
    check_quantized_load(folder, quantizer)
    print(f"checked {quantizer}")
