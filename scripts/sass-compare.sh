#!/usr/bin/env bash
# sass-compare.sh OLD_DIR NEW_DIR [OLD_NAME=NEW_NAME ...] — whether two builds' CUDA objects hold
# the same machine code: every kernel's SASS (cuobjdump -sass of every .o under each folder, keyed
# by the kernel's demangled name, instruction text only: the address column and the encodings are
# dropped, branch targets stay) and ptxas's register / stack / spill line per kernel (the .o.ptxas
# reports the build keeps beside its objects). A kernel compiled into several objects must come
# out the same in each. OLD_NAME=NEW_NAME pairs compare a renamed kernel under its new name (names
# as c++filt prints them, up to the opening parenthesis).
#
# Typical use: build main, `cp -r build/obj/src/cuda /tmp/old`, build the branch in a clean build
# folder (objects of moved sources would otherwise linger there), then
#   scripts/sass-compare.sh /tmp/old build/obj/src/cuda
# Prints one line per kernel (same / DIFFERENT / only in old / only in new) and ends with
# `N passed, N failed`; exits 1 on any difference. Needs cuobjdump, nvdisasm (CUDA toolkit; where
# it lacks them, the PyPI packages nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm hold both) and
# c++filt.
set -u
if [ $# -lt 2 ]; then
    echo "usage: $0 OLD_DIR NEW_DIR [OLD_NAME=NEW_NAME ...]" >&2
    exit 2
fi
old=$1
new=$2
shift 2
for tool in cuobjdump c++filt; do
    command -v "$tool" >/dev/null || { echo "sass-compare: $tool not found" >&2; exit 2; }
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# dump DIR OUT RENAMES: OUT/sass/NAME (normalised SASS) and OUT/regs/NAME (ptxas's line) per kernel.
dump() {
    local dir=$1 out=$2 renames=$3
    mkdir -p "$out/sass" "$out/regs"
    find "$dir" -name '*.o' | sort | while read -r obj; do
        local tag=${obj//[^A-Za-z0-9_.]/_}
        cuobjdump -sass "$obj" 2>/dev/null | awk -v out="$out/sass" -v tag="$tag" -v renames="$renames" '
            BEGIN { n = split(renames, pairs, " "); for (i = 1; i <= n; ++i) { split(pairs[i], kv, "="); map[kv[1]] = kv[2] } }
            /Function : / {
                mangled = $3
                cmd = "c++filt \"" mangled "\""; cmd | getline name; close(cmd)
                sub(/\(.*/, "", name)
                sub(/^void /, "", name) # a template kernel demangles with its return type
                if (name in map) name = map[name]
                file = out "/" name ".from." tag
                printf "" > file
                next
            }
            file != "" && /^ *\/\*[0-9a-f][0-9a-f][0-9a-f][0-9a-f]*\*\// {
                line = $0
                sub(/^ *\/\*[0-9a-f]+\*\/ */, "", line)   # the address column
                sub(/ *\/\* 0x[0-9a-f]+ \*\/ *$/, "", line) # the encoding
                sub(/ +$/, "", line)
                print line >> file
            }'
        if [ -f "$obj.ptxas" ]; then
            awk -v out="$out/regs" -v renames="$renames" '
                BEGIN { n = split(renames, pairs, " "); for (i = 1; i <= n; ++i) { split(pairs[i], kv, "="); map[kv[1]] = kv[2] } }
                /Function properties for / { cmd = "c++filt \"" $NF "\""; cmd | getline name; close(cmd); sub(/\(.*/, "", name); sub(/^void /, "", name)
                                            if (name in map) name = map[name]; frame = ""; next }
                name != "" && /bytes stack frame/ { sub(/^ +/, ""); frame = $0; next }
                name != "" && /Used [0-9]+ registers/ { sub(/^ptxas info *: */, ""); print frame "; " $0 > (out "/" name); name = "" }
            ' "$obj.ptxas"
        fi
    done
    # One file per kernel: copies from several objects must agree.
    local f base
    for f in "$out"/sass/*.from.*; do
        [ -e "$f" ] || continue
        base=${f%%.from.*}
        if [ -e "$base" ]; then
            cmp -s "$base" "$f" || echo "$(basename "$base"): its copies in $dir differ" >>"$out/conflicts"
        else
            cp "$f" "$base"
        fi
        rm -f "$f"
    done
}

renames="$*"
dump "$old" "$work/old" "$renames"
dump "$new" "$work/new" "$renames"
pass=0
fail=0
if [ -s "$work/old/conflicts" ] || [ -s "$work/new/conflicts" ]; then
    cat "$work/old/conflicts" "$work/new/conflicts" 2>/dev/null
    fail=$((fail + 1))
fi
for name in $( (ls "$work/old/sass"; ls "$work/new/sass") | sort -u); do
    o="$work/old/sass/$name"
    n="$work/new/sass/$name"
    if [ ! -e "$o" ]; then
        echo "only in new: $name"
        fail=$((fail + 1))
    elif [ ! -e "$n" ]; then
        echo "only in old: $name"
        fail=$((fail + 1))
    elif ! cmp -s "$o" "$n"; then
        echo "DIFFERENT: $name ($(wc -l <"$o") / $(wc -l <"$n") instructions)"
        diff "$o" "$n" | head -n 20
        fail=$((fail + 1))
    elif [ -e "$work/old/regs/$name" ] && ! cmp -s "$work/old/regs/$name" "$work/new/regs/$name" 2>/dev/null; then
        echo "DIFFERENT ptxas report: $name"
        echo "  old: $(cat "$work/old/regs/$name")"
        echo "  new: $(cat "$work/new/regs/$name" 2>/dev/null)"
        fail=$((fail + 1))
    else
        echo "same: $name ($(wc -l <"$n") instructions; $(cat "$work/new/regs/$name" 2>/dev/null || echo 'no ptxas report'))"
        pass=$((pass + 1))
    fi
done
echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
