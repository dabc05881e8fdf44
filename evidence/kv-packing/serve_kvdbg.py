import logging, runpy, sys
_orig = logging.Logger.setLevel
def _set(self, level):
    _orig(self, logging.DEBUG if self.name == "llama.cpp" else level)
logging.Logger.setLevel = _set
sys.argv = ["neuron-tai", *sys.argv[1:]]
runpy.run_module("neuron_tai.cli", run_name="__main__")
