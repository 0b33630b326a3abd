#!/usr/bin/env python3
"""Stalls of the measured CPU, from a trace of every scheduler switch and
interrupt on it (gaps.sh). In a pinned request/response run something
happens on the CPU every few microseconds (a switch, a softirq, a timer
interrupt); a gap longer than GAP_US with no event at all is time the
guest did not run or could not see. Prints, over the busiest 2 s window:
the number of such gaps per second, their length, and the timer
interrupts' own length."""
import bisect
import collections
import re
import sys

GAP_US = 15.0
path = sys.argv[1]
events = []
for line in open(path):
    m = re.search(r"\s(\d+\.\d+):\s+(\S+):", line)
    if m:
        events.append((float(m.group(1)), m.group(2).rstrip(":")))
switches = [t for t, n in events if n == "sched:sched_switch"]
best = (0, 0.0)
for i in range(0, len(switches), 500):
    j = bisect.bisect_left(switches, switches[i] + 2.0)
    if j - i > best[0]:
        best = (j - i, switches[i])
t0, t1 = best[1], best[1] + 2.0
window = [(t, n) for t, n in events if t0 <= t <= t1]
gaps = []
timer = []
start = None
for (ta, na), (tb, nb) in zip(window, window[1:]):
    if tb - ta > GAP_US * 1e-6:
        gaps.append(tb - ta)
for t, n in window:
    if n == "irq_vectors:local_timer_entry":
        start = t
    elif n == "irq_vectors:local_timer_exit" and start is not None:
        timer.append(t - start)
        start = None


def q(v, p):
    return sorted(v)[min(len(v) - 1, int(len(v) * p))] * 1e6


counts = collections.Counter(n for _, n in window)
print(f"window {t0:.3f}-{t1:.3f} s: {counts['sched:sched_switch']} switches, "
      f"{counts['irq:softirq_entry']} softirqs, {counts['irq_vectors:local_timer_entry']} timer interrupts")
print(f"median time between events: {q([b[0]-a[0] for a, b in zip(window, window[1:])], 0.5):.1f} us")
if gaps:
    print(f"gaps > {GAP_US:.0f} us with no event: {len(gaps)/2.0:.0f} per second, "
          f"p50 {q(gaps, .5):.1f} us, p90 {q(gaps, .9):.1f} us, max {q(gaps, 1):.1f} us, "
          f"{sum(gaps)/2.0*100:.2f} % of the CPU's time")
if timer:
    print(f"timer interrupt, entry to exit: p50 {q(timer, .5):.1f} us, p99 {q(timer, .99):.1f} us")
