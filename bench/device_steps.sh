# Sourced by the device scripts (bench/h200_session.sh, bench/batch_invariant_h200.sh): `step`
# runs one named step under its own time limit, appending to "$log", unless ONLY names others.
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    if [[ -n ${ONLY:-} && " $ONLY " != *" $name "* ]]; then
        return
    fi
    echo "::: $name" | tee -a "$log"
    local start=$SECONDS
    timeout "$limit" "$@" >> "$log" 2>&1
    echo "::: $name exit $? after $((SECONDS - start)) s" | tee -a "$log"
}
