// Builds the driver bundle (one file per module format, no Node built-ins: shims/ stand in for
// those pg requires), its bundled .d.ts, and the Node-only proxy with its CLI.
import * as esbuild from 'esbuild'
import { execFileSync } from 'node:child_process'
import { copyFileSync, rmSync } from 'node:fs'

const shim = (name) => `./shims/${name}.ts`
const driver = {
  entryPoints: ['src/index.ts'],
  bundle: true,
  platform: 'neutral',
  mainFields: ['module', 'main'],
  target: 'es2022',
  minify: true,
  legalComments: 'none',
  inject: [shim('globals')],
  define: { global: 'globalThis' },
  alias: {
    net: shim('net'),
    util: shim('util'),
    'util/types': shim('util'),
    crypto: shim('crypto'),
    pgpass: './shims/pgpass.cjs',
    tls: shim('unavailable'),
    dns: shim('unavailable'),
    fs: shim('unavailable'),
    path: shim('unavailable'),
    stream: shim('unavailable'),
    string_decoder: shim('unavailable'),
    'pg-native': shim('unavailable'),
    'pg-cloudflare': shim('unavailable'),
  },
  metafile: true,
}

rmSync('dist', { recursive: true, force: true })
const results = await Promise.all([
  // ESM splits out what is imported lazily (subtls, for TLS inside the socket) into its own chunk.
  esbuild.build({ ...driver, format: 'esm', splitting: true, outdir: 'dist', chunkNames: 'chunks/[name]-[hash]', outExtension: { '.js': '.mjs' } }),
  esbuild.build({ ...driver, format: 'cjs', outfile: 'dist/index.cjs' }),
  esbuild.build({
    entryPoints: { proxy: 'proxy/index.ts', cli: 'proxy/cli.ts' },
    outdir: 'dist',
    outExtension: { '.js': '.mjs' },
    bundle: true,
    platform: 'node',
    format: 'esm',
    target: 'node20',
    packages: 'external',
  }),
])

// The driver must not pull in any Node built-in: every one of them is shimmed above.
const builtins = Object.keys(results[0].metafile.inputs).filter((p) => p.startsWith('node:') || !p.includes('/'))
if (builtins.length) throw new Error(`Node built-ins reached the driver bundle: ${builtins.join(', ')}`)

const dts = (entry, out) => execFileSync('npx', ['dts-bundle-generator', '--silent', '--no-check', '-o', out, entry], { stdio: 'inherit' })
dts('src/index.ts', 'dist/index.d.ts')
dts('proxy/index.ts', 'dist/proxy.d.ts')
copyFileSync('dist/index.d.ts', 'dist/index.d.cts')
