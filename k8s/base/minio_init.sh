#!/bin/sh
# One-shot MinIO setup (compose service minio-init, Kubernetes Job minio-init): the bucket, and an
# application key that may list, read, write and delete objects in that bucket and nothing else
# (no bucket policy, no bucket deletion, no other bucket, no admin API).
#
# Idempotent: each step sets a state instead of adding to one (mb --ignore-existing; policy create
# replaces the document; user add sets the secret again; policy attach succeeds when the policy is
# already attached, mc RELEASE.2024-10-08 and later), and the last step reads the state back.
# It runs with `mc` and the shell's built-ins only: the minio/mc image need not have grep or cat.
# Needs MINIO_URL, MINIO_ROOT_USER, MINIO_ROOT_PASSWORD, BUCKET, APP_ACCESS_KEY, APP_SECRET_KEY.
# With CAPTURE_ACCESS_KEY and CAPTURE_SECRET_KEY (Kubernetes: SGLang's s3 capture sink), a second
# key for the SGLang server alone: list, write, read and delete objects under CAPTURE_PREFIX
# (default capture/) of that bucket and nothing else, so a compromised server cannot read or
# overwrite datasets, runs or drafters.
set -eu
: "${MINIO_URL:?}" "${MINIO_ROOT_USER:?}" "${MINIO_ROOT_PASSWORD:?}" "${BUCKET:?}" "${APP_ACCESS_KEY:?}" "${APP_SECRET_KEY:?}"
POLICY=aerie-app
export MC_CONFIG_DIR="${MC_CONFIG_DIR:-/tmp/.mc}"
mc() { command mc --config-dir "$MC_CONFIG_DIR" "$@"; }

if [ "$APP_ACCESS_KEY" = "$MINIO_ROOT_USER" ]; then
  echo "minio-init: AERIE_S3_ACCESS_KEY equals MINIO_ROOT_USER: give the application a key of its own" >&2
  exit 64
fi
mc alias set root "$MINIO_URL" "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD" >/dev/null
mc mb --ignore-existing "root/$BUCKET" >/dev/null

# What aerie's store and the SGLang plugin's s3 sink call: ListObjects and HeadBucket on the
# bucket; Put (multipart included), Get, Stat and Delete on its objects.
policy_file="${TMPDIR:-/tmp}/aerie-app-policy.$$.json"
printf '%s\n' '{"Version": "2012-10-17", "Statement": [' \
  '{"Effect": "Allow", "Action": ["s3:GetBucketLocation", "s3:ListBucket", "s3:ListBucketMultipartUploads"],' \
  " \"Resource\": [\"arn:aws:s3:::$BUCKET\"]}," \
  '{"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload",' \
  ' "s3:ListMultipartUploadParts"], "Resource": ["arn:aws:s3:::'"$BUCKET"'/*"]}]}' > "$policy_file"
# key secret policy document: the key set, the policy replaced and attached, then read back
# (`mc --json admin user info` prints "policyName": "p1,p2", absent when none)
grant() {
  mc admin policy create root "$3" "$4" >/dev/null
  mc admin user add root "$1" "$2" >/dev/null
  mc admin policy attach root "$3" --user "$1" >/dev/null
  info=$(mc --json admin user info root "$1")
  policies=""
  case "$info" in
    *'"policyName": "'*) policies=${info#*\"policyName\": \"}; policies=${policies%%\"*} ;;
  esac
  case ",$policies," in
    *",$3,"*) ;;
    *) echo "minio-init: key $1 has policies [$policies] after attaching $3: check the server's IAM (mc admin user info)" >&2
       exit 1 ;;
  esac
}
grant "$APP_ACCESS_KEY" "$APP_SECRET_KEY" "$POLICY" "$policy_file"
echo "minio-init: bucket $BUCKET ready; key $APP_ACCESS_KEY may list, read, write and delete objects in it only"

if [ -n "${CAPTURE_ACCESS_KEY:-}${CAPTURE_SECRET_KEY:-}" ]; then
  : "${CAPTURE_ACCESS_KEY:?CAPTURE_ACCESS_KEY is empty while CAPTURE_SECRET_KEY is set}" "${CAPTURE_SECRET_KEY:?CAPTURE_SECRET_KEY is empty while CAPTURE_ACCESS_KEY is set}"
  prefix="${CAPTURE_PREFIX:-capture/}"
  case "$prefix" in
    datasets/ | runs/ | drafters/ | checkpoints/ | probes/ | */*/ | .* | *[!A-Za-z0-9._/-]*) prefix_ok=no ;;
    [A-Za-z0-9_-]*/) prefix_ok=yes ;;
    *) prefix_ok=no ;;
  esac
  if [ "$prefix_ok" = no ]; then
    echo "minio-init: CAPTURE_PREFIX $prefix is not one plain 'name/' segment outside aerie's own folders" >&2
    exit 64
  fi
  if [ "$CAPTURE_ACCESS_KEY" = "$APP_ACCESS_KEY" ] || [ "$CAPTURE_ACCESS_KEY" = "$MINIO_ROOT_USER" ]; then
    echo "minio-init: CAPTURE_ACCESS_KEY must be a key of its own (not the application's or root's)" >&2
    exit 64
  fi
  # What the plugin's s3 sink calls: ListObjectsV2 of its prefix (the bound, the TTL), Put (multipart
  # included) and Delete of its captures; Get/Stat for nothing else.
  capture_file="${TMPDIR:-/tmp}/aerie-capture-policy.$$.json"
  printf '%s\n' '{"Version": "2012-10-17", "Statement": [' \
    '{"Effect": "Allow", "Action": ["s3:ListBucket"], "Resource": ["arn:aws:s3:::'"$BUCKET"'"],' \
    ' "Condition": {"StringLike": {"s3:prefix": ["'"$prefix"'*"]}}},' \
    '{"Effect": "Allow", "Action": ["s3:GetBucketLocation"], "Resource": ["arn:aws:s3:::'"$BUCKET"'"]},' \
    '{"Effect": "Allow", "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload",' \
    ' "s3:ListMultipartUploadParts"], "Resource": ["arn:aws:s3:::'"$BUCKET"'/'"$prefix"'*"]}]}' > "$capture_file"
  grant "$CAPTURE_ACCESS_KEY" "$CAPTURE_SECRET_KEY" aerie-capture "$capture_file"
  echo "minio-init: key $CAPTURE_ACCESS_KEY may list, write and delete objects under $BUCKET/$prefix only"
fi
