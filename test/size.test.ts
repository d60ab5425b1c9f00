/**
 * Bundle budgets, on the built dist/ (what users get), bundled the way an app's bundler does it
 * (esbuild, minified; sizes gzipped at level 9, 1 KB = 1000 bytes):
 *  - the driver, everything edgepg exports, ≤ 43 KB (40 KB until it took Neon's names, AbortSignal
 *    and query_timeout cancels, Workers' module-scope Pool and the Pool's transaction guard; 42 KB
 *    until it carried WAL positions for reads on replicas, config.lastWrite): ESM (what loads up front; the lazily imported
 *    TLS handshake with subtls and the md5 for md5 passwords stay out, as a splitting bundler
 *    or a browser leaves them) and dist/index.cjs as it is;
 *  - an app that imports only httpSql, bundled without splitting, ≤ 10 KB; and it runs in a bare
 *    V8 context (no Buffer, process or require) against the real /sql endpoint;
 *  - no Node built-in reaches any of them.
 * bench/ prints the same figures next to @neondatabase/serverless.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { readFileSync } from 'node:fs'
import vm from 'node:vm'
import { webcrypto } from 'node:crypto'
import { driverSizes, appBundle } from './support/sizes'
import { startProxy, testPostgres } from './support/helpers'
import { PASSWORD } from './support/stack'

const KB = 1000

let proxy: Awaited<ReturnType<typeof startProxy>>
before(async () => (proxy = await startProxy()))
after(() => proxy.close())

test('the driver bundle is ≤ 43 KB gzipped, ESM and CommonJS, with no Node built-ins', async () => {
  const sizes = await driverSizes()
  assert.ok(sizes.esm.gzip <= 43 * KB, `ESM driver (index + its static chunks, minified): ${sizes.esm.gzip} bytes gzipped, over 43 KB`)
  assert.ok(sizes.cjs.gzip <= 43 * KB, `dist/index.cjs: ${sizes.cjs.gzip} bytes gzipped, over 43 KB`)
  assert.deepEqual(sizes.esm.builtins, [], 'no Node built-in in the ESM driver')
  assert.equal(sizes.esm.lazy.some((f) => /tls-handshake/.test(f)), true, `the TLS handshake is a lazy chunk: ${sizes.esm.lazy}`)
  // The lazy TLS handshake must carry subtls: bundled, not left for the app to find.
  assert.ok(sizes.esm.lazyGzip > 10 * KB, `the lazy chunks hold subtls (${sizes.esm.lazyGzip} bytes gzipped)`)
})

test('an app that imports only httpSql bundles to ≤ 10 KB gzipped, with no Node built-ins, and runs with no Buffer', async () => {
  const { host, port, database } = testPostgres()
  const app = await appBundle(`import { httpSql } from 'edgepg'
const sql = httpSql(${JSON.stringify(`postgresql://scram_user:${encodeURIComponent(PASSWORD)}@${host}:${port}/${database}`)}, { fetchEndpoint: ${JSON.stringify(`http://127.0.0.1:${proxy.port}/sql`)} })
globalThis.result = sql\`SELECT \${2}::int * 21 AS n, '\\\\x00ff10'::bytea AS b, ARRAY['\\\\x0102'::bytea] AS bs\``, { format: 'iife' })
  assert.ok(app.gzip <= 10 * KB, `httpSql-only app: ${app.gzip} bytes gzipped, over 10 KB`)
  assert.deepEqual(app.builtins, [], 'no Node built-in in the httpSql-only app')
  assert.ok(!app.inputs.some((p) => /node_modules\/buffer\//.test(p)) && !/class Client|SASL/.test(app.code), `the app carries neither the Buffer polyfill nor the WebSocket driver: ${app.inputs.filter((p) => /buffer|pg\/lib\/client/.test(p))}`)

  // A bare V8 context with what a browser offers: fetch, but no Buffer, process or require.
  const context = vm.createContext({ fetch, Headers, URL, TextEncoder, TextDecoder, AbortSignal, setTimeout, clearTimeout, queueMicrotask, console })
  vm.runInContext(app.code, context)
  assert.equal(vm.runInContext('typeof Buffer + typeof process + typeof require', context), 'undefinedundefinedundefined', 'no Node globals in the context')
  const bareUint8Array = vm.runInContext('Uint8Array', context)
  const [row] = JSON.parse(JSON.stringify(await context.result, (_k, v) => (v instanceof bareUint8Array ? { bytes: [...v] } : v)))
  // Without the driver there is no Buffer: bytea arrives as a plain Uint8Array with the right bytes.
  assert.deepEqual(row, { n: 42, b: { bytes: [0, 255, 16] }, bs: [{ bytes: [1, 2] }] }, 'the row, bytea as Uint8Array')
})

test('with the driver loaded, bytea is a Buffer everywhere (the polyfill is installed before pg loads)', async () => {
  const { host, port, database } = testPostgres()
  const context = vm.createContext({ fetch, Headers, URL, TextEncoder, TextDecoder, AbortSignal, setTimeout, clearTimeout, queueMicrotask, console, crypto: webcrypto })
  const mod: { exports: any } = { exports: {} }
  vm.runInContext(`(function (module, exports) {${readFileSync(new URL('../dist/index.cjs', import.meta.url), 'utf8')}\n})`, context)(mod, mod.exports)
  const sql = mod.exports.httpSql(`postgresql://scram_user:${encodeURIComponent(PASSWORD)}@${host}:${port}/${database}`, { fetchEndpoint: `http://127.0.0.1:${proxy.port}/sql` })
  const [row] = await sql`SELECT '\\x00ff'::bytea AS b`
  // (the polyfill's class name is minified away: recognise it by Buffer's own methods)
  assert.ok(typeof row.b?.readInt16BE === 'function' && typeof row.b.equals === 'function', `bytea parsed into the polyfill's Buffer, got ${row.b?.constructor?.name}`)
  assert.equal(row.b.toString('hex'), '00ff', 'the bytes')
})
