"""Run by tests/test_quantization.py in a Python that can import the quantizers (PYTHONPATH names the folder that
scripts/setup_env.sh installs them in):

    python quantization_worker.py load FOLDER QUANTIZER...   # check_quantized_load; prints "checked QUANTIZER" each
    python quantization_worker.py qlora FOLDER ADAPTER       # check_qlora; prints "checked qlora"

A failed check is a traceback and exit code 1."""

import sys

from test_quantization import check_qlora, check_quantized_load

if __name__ == "__main__":
    check, folder, *rest = sys.argv[1:]
    if check == "load":
        for quantizer in rest:
            check_quantized_load(folder, quantizer)
            print(f"checked {quantizer}", flush=True)
    else:
        check_qlora(folder, *rest)
        print("checked qlora")
