#!/bin/sh
# One-shot MinIO setup (compose service minio-init, Kubernetes Job minio-init): the bucket, and
# an application key limited to it. Idempotent. Needs MINIO_URL, MINIO_ROOT_USER,
# MINIO_ROOT_PASSWORD, BUCKET, APP_ACCESS_KEY, APP_SECRET_KEY.
set -eu
export MC_CONFIG_DIR="${MC_CONFIG_DIR:-/tmp/.mc}"
mc() { command mc --config-dir "$MC_CONFIG_DIR" "$@"; }
mc alias set root "$MINIO_URL" "$MINIO_ROOT_USER" "$MINIO_ROOT_PASSWORD" >/dev/null
mc mb --ignore-existing "root/$BUCKET"
cat > /tmp/aerie-policy.json <<JSON
{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": ["s3:*"],
  "Resource": ["arn:aws:s3:::$BUCKET", "arn:aws:s3:::$BUCKET/*"]}]}
JSON
mc admin policy create root aerie-app /tmp/aerie-policy.json >/dev/null
mc admin user add root "$APP_ACCESS_KEY" "$APP_SECRET_KEY" >/dev/null
if ! mc admin user info root "$APP_ACCESS_KEY" | grep -q "aerie-app"; then
  mc admin policy attach root aerie-app --user "$APP_ACCESS_KEY" >/dev/null
fi
echo "minio-init: bucket $BUCKET ready, key $APP_ACCESS_KEY limited to it"
