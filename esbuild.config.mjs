// Builds the driver bundle (one file per module format, no Node built-ins: shims/ stand in for
// those pg requires), its bundled .d.ts, and the Node-only proxy with its CLI.
import * as esbuild from 'esbuild'
import { minify } from 'terser'
import { execFileSync } from 'node:child_process'
import { copyFileSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs'
import { createRequire } from 'node:module'
import { fileURLToPath } from 'node:url'

const shim = (name) => `./shims/${name}.ts`
const driver = {
  entryPoints: ['src/index.ts'],
  bundle: true,
  platform: 'neutral',
  mainFields: ['module', 'main'],
  target: 'es2022',
  minify: true,
  legalComments: 'none',
  inject: [shim('process'), shim('buffer')],
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
  plugins: [
    {
      // pg modules a WebSocket driver never runs (pg.native's libpq; pg's own TCP/TLS sockets; the
      // certificate parsing of SCRAM-SHA-256-PLUS, which needs a socket with getPeerCertificate)
      // are replaced by shims/pg/<name>.cjs.
      name: 'pg-internals',
      setup(build) {
        build.onResolve({ filter: /^\.\/(native|stream|cert-signatures)$/ }, ({ path, importer }) =>
          /[\\/]node_modules[\\/]pg[\\/]lib[\\/]/.test(importer) ? { path: fileURLToPath(new URL(`./shims/pg/${path.slice(2)}.cjs`, import.meta.url)) } : undefined)
        // pg's CommonJS entry, not its ESM wrapper (whose re-exports are property reads no minifier can drop).
        build.onResolve({ filter: /^pg$/ }, () => ({ path: createRequire(import.meta.url).resolve('pg') }))
        build.onResolve({ filter: /^events$/ }, ({ importer }) => (/[\\/]shims[\\/]events\.cjs$/.test(importer) ? undefined : { path: fileURLToPath(new URL('./shims/events.cjs', import.meta.url)) }))
        // pg's SCRAM client, loaded on first use (shims/pg/sasl.ts), except by src/scram.ts, which is it.
        build.onResolve({ filter: /^(\.\/crypto\/sasl|pg\/lib\/crypto\/sasl\.js)$/ }, ({ importer }) =>
          /[\\/]src[\\/]scram\.ts$/.test(importer) ? undefined : { path: fileURLToPath(new URL('./shims/pg/sasl.ts', import.meta.url)) })
      },
    },
  ],
  metafile: true,
}

rmSync('dist', { recursive: true, force: true })
const results = await Promise.all([
  // ESM: index.mjs only re-exports (from client.mjs and http.mjs), so that an app importing just
  // httpSql leaves the WebSocket driver out. What is imported lazily (the TLS handshake with subtls,
  // md5) gets a file of its own.
  esbuild.build({
    ...driver,
    entryPoints: { index: 'src/index.ts', client: 'src/client.ts', http: 'src/http.ts', 'tls-handshake': 'src/tls-handshake.ts', scram: 'src/scram.ts' },
    format: 'esm',
    splitting: true,
    outdir: 'dist',
    chunkNames: 'chunks/[name]-[hash]',
    outExtension: { '.js': '.mjs' },
  }),
  // CommonJS cannot split: it loads the TLS handshake (and subtls) and SCRAM from the ESM build when needed.
  esbuild.build({
    ...driver,
    format: 'cjs',
    outfile: 'dist/index.cjs',
    plugins: [
      { name: 'lazy', setup: (build) => build.onResolve({ filter: /^(\.\/tls-handshake|\.\.\/\.\.\/src\/scram)$/ }, ({ path }) => ({ path: `./${path.split('/').pop()}.mjs`, external: true })) },
      ...driver.plugins,
    ],
  }),
  // For Node (not Deno, Bun or bundlers for the edge): the same source on the installed pg, not a
  // copy of it, so that edgepg's Pool and Client are instances of pg's own classes: libraries that
  // check (`instanceof pg.Pool`, as @prisma/adapter-pg and Drizzle do) take them for what they are.
  ...['esm', 'cjs'].map((format) =>
    esbuild.build({
      entryPoints: ['src/index.ts'],
      outfile: `dist/node.${format === 'esm' ? 'mjs' : 'cjs'}`,
      bundle: true,
      platform: 'node',
      format,
      target: 'node20',
      external: ['pg', 'pg/*', 'pg-protocol', 'pg-protocol/*'],
      plugins: [
        {
          // httpSql's errors are pg's own DatabaseError (instanceof works both ways), not a copy's.
          name: 'pg-database-error',
          setup(build) {
            build.onResolve({ filter: /^pg-protocol\/dist\/messages\.js$/ }, ({ importer }) =>
              /[\\/]src[\\/]http\.ts$/.test(importer) ? { path: 'messages', namespace: 'pg-messages' } : undefined)
            build.onLoad({ filter: /.*/, namespace: 'pg-messages' }, () => ({
              contents: "import pg from 'pg'\nexport const { DatabaseError } = pg\nexport { Field } from 'pg-protocol/dist/messages.js'\n",
              resolveDir: process.cwd(),
            }))
          },
        },
      ],
    })
  ),
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

// terser minifies a further 5% beyond esbuild; the driver is what users download.
const driverFiles = ['index.cjs', ...readdirSync('dist').filter((f) => f.endsWith('.mjs') && !/^(proxy|cli|node)\./.test(f)), ...readdirSync('dist/chunks').map((f) => `chunks/${f}`)]
for (const file of driverFiles.map((f) => `dist/${f}`)) {
  const { code } = await minify(readFileSync(file, 'utf8'), { module: file.endsWith('.mjs'), ecma: 2020, format: { preserve_annotations: true } })
  writeFileSync(file, code)
}

// The driver must not pull in any Node built-in: every one of them is shimmed above.
const builtins = Object.keys(results[0].metafile.inputs).filter((p) => p.startsWith('node:') || !p.includes('/'))
if (builtins.length) throw new Error(`Node built-ins reached the driver bundle: ${builtins.join(', ')}`)

const dts = (entry, out) => execFileSync('npx', ['dts-bundle-generator', '--silent', '--no-check', '-o', out, entry], { stdio: 'inherit' })
dts('src/index.ts', 'dist/index.d.ts')
dts('proxy/index.ts', 'dist/proxy.d.ts')
copyFileSync('dist/index.d.ts', 'dist/index.d.cts')
