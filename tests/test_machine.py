"""decoder/machine.py: the one reader of /proc/cpuinfo and /proc/meminfo, on fixture
texts of an AVX2-only VM and an AVX-512/AMX server with hyper-threading."""
import os
import re

from decoder import machine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

AVX2_FLAGS = ("fpu vme de pse tsc msr pae mce cx8 apic sep mtrr sse sse2 ht syscall nx mmxext lm "
              "pni ssse3 fma cx16 sse4_1 sse4_2 movbe popcnt aes xsave avx f16c rdrand bmi1 avx2 bmi2")
EPYC_VM = "".join(f"""processor\t: {i}
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC
physical id\t: 0
siblings\t: 2
core id\t\t: {i}
cpu cores\t: 2
flags\t\t: {AVX2_FLAGS}

""" for i in range(2))

SPR_FLAGS = AVX2_FLAGS + (" avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni avx512_bf16 "
                          "amx_bf16 amx_tile amx_int8")
# 2 cores x 2 hyper-threads: processors 0/2 and 1/3 share a core
SAPPHIRE = "".join(f"""processor\t: {i}
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
physical id\t: 0
core id\t\t: {i % 2}
flags\t\t: {SPR_FLAGS}

""" for i in range(4))

# no core ids (some hypervisors): cores fall back to the logical CPUs
ICELAKE_NO_TOPOLOGY = "".join(f"""processor\t: {i}
model name\t: Intel Xeon Processor (Icelake)
flags\t\t: {AVX2_FLAGS} avx512f avx512bw avx512_vnni

""" for i in range(8))

MEMINFO = "MemTotal:       24576000 kB\nMemFree:        1000 kB\nMemAvailable:   2000 kB\n"


def test_avx2_only_vm_has_no_avx512_and_no_native_bf16():
    cpu = machine.parse_cpuinfo(EPYC_VM)
    assert cpu == {"cpu": "AMD EPYC", "cores": 2, "threads": 2, "flags": ["avx2", "fma"]}
    assert machine.isa(cpu["flags"]) == "AVX2" and machine.ct2_isa(cpu["flags"]) == "AVX2"
    assert not machine.has_native_bf16(cpu["flags"])


def test_avx512_amx_server_counts_hyperthreads_apart_from_cores():
    cpu = machine.parse_cpuinfo(SAPPHIRE)
    assert cpu["cpu"].startswith("Intel(R) Xeon(R) Platinum 8481C")
    assert (cpu["cores"], cpu["threads"]) == (2, 4)
    assert cpu["flags"] == list(machine.ISA_FLAGS)  # every flag that picks a kernel, in a fixed order
    assert machine.isa(cpu["flags"]) == "AMX" and machine.ct2_isa(cpu["flags"]) == "AVX512"
    assert machine.has_native_bf16(cpu["flags"])


def test_avx512_without_core_ids_names_its_extensions():
    cpu = machine.parse_cpuinfo(ICELAKE_NO_TOPOLOGY)
    assert (cpu["cores"], cpu["threads"]) == (8, 8)
    assert machine.isa(cpu["flags"]) == "AVX-512+VNNI"
    assert not machine.has_native_bf16(cpu["flags"])


def test_meminfo_total_in_gib_and_none_when_absent():
    assert machine.parse_meminfo(MEMINFO) == 23.4
    assert machine.parse_meminfo("MemFree: 10 kB\n") is None


def test_describe_reads_the_given_files_and_one_line_names_isa_threads_date_versions(tmp_path):
    (tmp_path / "cpuinfo").write_text(SAPPHIRE)
    (tmp_path / "meminfo").write_text(MEMINFO)
    hw = machine.describe(cpuinfo=str(tmp_path / "cpuinfo"), meminfo=str(tmp_path / "meminfo"))
    assert (hw["cores"], hw["threads"], hw["memory_gb"], hw["isa"], hw["ct2_isa"]) == (2, 4, 23.4, "AMX", "AVX512")
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", hw["date"]) and hw["versions"]["torch"]
    line = machine.one_line(hw)
    for part in ("Xeon", "AMX", "2 cores / 4 threads", "23.4 GB", hw["date"], f"torch {hw['versions']['torch']}"):
        assert part in line, (part, line)


def test_missing_proc_files_still_describe_the_machine(tmp_path):
    hw = machine.describe(cpuinfo=str(tmp_path / "none"), meminfo=str(tmp_path / "none"))
    assert hw["threads"] == os.cpu_count() and hw["cores"] >= 1 and hw["memory_gb"] is None
    assert hw["cpu"] and machine.one_line(hw)


def test_proc_cpuinfo_and_meminfo_are_read_in_one_place():
    """The container's cgroup reader is apart: it runs in the image, reading a limit, not the machine."""
    readers = set()
    for top in ("decoder", "student", "submission", "tools"):
        for d, dirs, names in os.walk(os.path.join(ROOT, top)):
            for n in names:
                path = os.path.join(d, n)
                if n.endswith(".py") and re.search(r"/proc/(cpuinfo|meminfo)", open(path).read()):
                    readers.add(os.path.relpath(path, ROOT))
    assert readers == {"decoder/machine.py", "decoder/cgroup.py"}, readers
