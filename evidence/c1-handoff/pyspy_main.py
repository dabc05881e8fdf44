"""Summarise a py-spy raw profile: the main thread's samples by innermost frame and by frame inclusive."""
import sys
from collections import Counter

inclusive: Counter[str] = Counter()
innermost: Counter[str] = Counter()
total = 0
for line in open(sys.argv[1]):
    if not line.strip():
        continue
    stack, n = line.rsplit(" ", 1)
    frames = stack.split(";")
    if not frames[0].startswith("_run_module_as_main"):  # the main thread only
        continue
    total += int(n)
    for frame in set(frames):
        inclusive[frame[:90]] += int(n)
    innermost[frames[-1][:90]] += int(n)
print(f"main-thread samples: {total}")
print("-- innermost frame")
for frame, n in innermost.most_common(12):
    print(n, frame)
print("-- inclusive")
for frame, n in inclusive.most_common(24):
    print(n, frame)
