# Sourced by ab_candidates.sh and check_candidate.sh: copy_candidate NAME makes .ab/NAME, a copy of
# the tree (without .ab, .peers, .venv, .git) with benchmarks/lab/candidates/NAME.patch applied
# (`patch` where the machine has it, else `git apply`); returns 2, saying why, if the patch is
# missing or does not apply.
copy_candidate() {
  local name=$1 patch_file=benchmarks/lab/candidates/$1.patch
  [ -f "$patch_file" ] || { echo "no $patch_file"; return 2; }
  rm -rf ".ab/$name" && mkdir -p ".ab/$name"
  tar c --exclude=./.ab --exclude=./.peers --exclude=./.venv --exclude=./.git . | tar x -C ".ab/$name"
  if command -v patch >/dev/null; then
    patch -s -p1 -d ".ab/$name" < "$patch_file" || { echo "$name: the patch does not apply"; return 2; }
  else
    (cd ".ab/$name" && GIT_CEILING_DIRECTORIES="$(cd .. && pwd)" git apply "../../$patch_file") \
      || { echo "$name: the patch does not apply"; return 2; }
  fi
}
