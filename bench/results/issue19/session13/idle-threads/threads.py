import os, sys, time, json, subprocess
# Samples every shunt process's threads (name, voluntary+nonvoluntary switches) every 0.25 s.
out = open(sys.argv[1], "w")
end = time.time() + float(sys.argv[2])
while time.time() < end:
    t = time.time()
    try:
        pids = subprocess.run(["pgrep", "-x", "shunt"], capture_output=True, text=True).stdout.split()
    except Exception:
        pids = []
    for pid in pids:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                st = open(f"/proc/{pid}/task/{tid}/status").read()
                name = st.split("\n", 1)[0].split("\t", 1)[1]
                v = int(st.split("voluntary_ctxt_switches:\t")[1].split("\n")[0])
                nv = int(st.split("nonvoluntary_ctxt_switches:\t")[1].split("\n")[0])
                out.write(json.dumps([t, int(pid), int(tid), name, v, nv]) + "\n")
        except Exception:
            pass
    out.flush()
    time.sleep(0.25)
