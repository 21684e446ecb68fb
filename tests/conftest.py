import os
import socket
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def reachable(host, port=443, timeout=3.0):
    try:
        socket.create_connection((host, port), timeout=timeout).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="session")
def hf_hub_online():
    if os.environ.get("HF_HUB_OFFLINE") == "1" or not reachable("huggingface.co"):
        pytest.skip("the Hugging Face hub is not reachable from this machine (offline)")
