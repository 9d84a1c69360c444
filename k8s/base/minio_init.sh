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
mc admin policy create root "$POLICY" "$policy_file" >/dev/null
mc admin user add root "$APP_ACCESS_KEY" "$APP_SECRET_KEY" >/dev/null
mc admin policy attach root "$POLICY" --user "$APP_ACCESS_KEY" >/dev/null

# Read it back: `mc --json admin user info` prints "policyName": "p1,p2" (absent when none).
info=$(mc --json admin user info root "$APP_ACCESS_KEY")
policies=""
case "$info" in
  *'"policyName": "'*) policies=${info#*\"policyName\": \"}; policies=${policies%%\"*} ;;
esac
case ",$policies," in
  *",$POLICY,"*) ;;
  *) echo "minio-init: key $APP_ACCESS_KEY has policies [$policies] after attaching $POLICY: check the server's IAM (mc admin user info)" >&2
     exit 1 ;;
esac
echo "minio-init: bucket $BUCKET ready; key $APP_ACCESS_KEY may list, read, write and delete objects in it only"
