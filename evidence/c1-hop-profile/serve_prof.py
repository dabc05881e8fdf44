"""`neuron-tai serve` with cProfile on the main thread between SIGUSR1 (start) and SIGUSR2 (stop, dump to PROF_OUT)."""
import cProfile, os, signal, sys
from neuron_tai.cli import main
prof = cProfile.Profile()
signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
def stop(*_):
    prof.disable(); prof.dump_stats(os.environ["PROF_OUT"])
signal.signal(signal.SIGUSR2, stop)
sys.exit(main(sys.argv[1:]))
