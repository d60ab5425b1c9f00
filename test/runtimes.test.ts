/**
 * The built bundle (dist/, what users get) in other runtimes, against the test Postgres through an
 * in-process edgepg-proxy (ws:// on 127.0.0.1), each with its own global WebSocket and fetch:
 *  - Deno and Bun (npm packages `deno`, `bun`) run test/runtimes/smoke.mjs, which imports
 *    dist/index.mjs and prints one JSON line. `deno` is pinned to 2.9.5: the registry reachable
 *    here lacks 2.9.6's other-platform binaries (@deno/darwin-arm64 etc.), so a 2.9.6 lock misses
 *    them and `npm ci` rejects it; 2.9.5 has all six, so its lock is complete;
 *  - Vercel's edge-runtime (npm package `edge-runtime`) evaluates dist/index.cjs in its EdgeVM
 *    (a script context: no ES modules, no process/Buffer/require, no eval), whose own WebSocket,
 *    fetch and crypto come from @edge-runtime/primitives.
 * Each covers Client (connect, parameterized query, end), Pool (query, end), pipelined connect
 * (the proxy selected the auth-offload subprotocol) and httpSql against the proxy's POST /sql:
 * the checks themselves are test/runtimes/checks.js, shared by every runtime. Then reads from a
 * lagging replica right after writes (a Client's and httpSql's), through a proxy with --replica.
 * `npm test` builds dist/ first.
 */
import { test, before, after } from 'node:test'
import assert from 'node:assert/strict'
import { spawn } from 'node:child_process'
import { existsSync, readFileSync } from 'node:fs'
import { fileURLToPath } from 'node:url'
import { EdgeRuntime } from 'edge-runtime'
import { startProxy, testPostgres, within } from './support/helpers'
import { PASSWORD } from './support/stack'
import { assertChecks } from './runtimes/assert-checks'
import { token, tokenFixture } from './support/tokens'
import { replicaFixture } from './support/standby'

const root = fileURLToPath(new URL('..', import.meta.url))
const SMOKE = fileURLToPath(new URL('./runtimes/smoke.mjs', import.meta.url))
const CHECKS = fileURLToPath(new URL('./runtimes/checks.js', import.meta.url))
const TIMEOUT_MS = 20_000

let proxy: Awaited<ReturnType<typeof startProxy>>
/** A proxy taking logins by token (transaction mode, the default), the table its users' rows are in, and a token each. */
let tokens: { proxyPort: number; table: string; alice: string; bob: string }
let fixture: Awaited<ReturnType<typeof tokenFixture>>
let byToken: Awaited<ReturnType<typeof startProxy>> | undefined
/** A primary of its own with a lagging standby, and a proxy reading from it. */
let replicas: Awaited<ReturnType<typeof replicaFixture>>
let withReplica: Awaited<ReturnType<typeof startProxy>> | undefined
const TABLE = `runtime_notes_${process.pid}`
before(async () => {
  // Session mode: the checks compare processID with pg_backend_pid(), which transaction mode shares among a key's sessions.
  proxy = await startProxy({ pool: { mode: 'session' } })
  fixture = await tokenFixture(TABLE)
  byToken = await startProxy({ tokens: fixture.options, pool: { listenPolicy: fixture.listenPolicy } })
  tokens = { proxyPort: byToken.port, table: TABLE, alice: await token('alice', { seconds: 600 }), bob: await token('bob', { seconds: 600 }) }
  replicas = await replicaFixture('runtimes-primary')
  withReplica = await startProxy({ upstream: replicas.upstream, replicas: replicas.replicas })
})
after(async () => {
  await proxy.close()
  await byToken?.close()
  await withReplica?.close()
  await fixture?.teardown()
  await replicas?.teardown()
})

const smokeOptions = () => ({ proxyPort: proxy.port, ...testPostgres(), password: PASSWORD, tokens, replica: replicas.checks(withReplica!.port) })

/** Runs smoke.mjs with `bin args…`, bounded; resolves with the exit code and the parsed JSON line. */
function runSmoke(bin: string, args: string[]): Promise<{ code: number | null; out: any; stdout: string; stderr: string }> {
  return new Promise((resolve, reject) => {
    const child = spawn(bin, [...args, SMOKE], {
      cwd: root,
      env: { ...process.env, EDGEPG_SMOKE: JSON.stringify(smokeOptions()), DENO_NO_UPDATE_CHECK: '1', NO_COLOR: '1' },
      stdio: ['ignore', 'pipe', 'pipe'],
    })
    let stdout = ''
    let stderr = ''
    child.stdout.setEncoding('utf8').on('data', (d: string) => (stdout += d))
    child.stderr.setEncoding('utf8').on('data', (d: string) => (stderr += d))
    const timer = setTimeout(() => child.kill('SIGKILL'), TIMEOUT_MS)
    child.once('error', (err) => (clearTimeout(timer), reject(err)))
    child.once('close', (code) => {
      clearTimeout(timer)
      const line = stdout.trim().split('\n').reverse().find((l) => l.startsWith('{'))
      let out: any
      try {
        out = line ? JSON.parse(line) : undefined
      } catch {}
      resolve({ code, out, stdout, stderr })
    })
  })
}

for (const [name, bin, args] of [
  // Deno: network only to the proxy on 127.0.0.1; all env vars, since pg's defaults read PG* and
  // USER (names built at run time); no --allow-read: importing the modules needs none.
  ['Deno', 'node_modules/.bin/deno', ['run', '--allow-net=127.0.0.1', '--allow-env', '--no-prompt', '--no-lock']],
  ['Bun', 'node_modules/.bin/bun', ['run']],
] as const) {
  test(`${name} runs dist/index.mjs with its global WebSocket: Client, Pool, the login in the upgrade, httpSql`, async () => {
    const path = `${root}${bin}`
    assert.ok(existsSync(path), `${path} exists (the ${name.toLowerCase()} devDependency, installed by npm ci)`)
    const { code, out, stdout, stderr } = await runSmoke(path, [...args])
    const detail = `exit ${code}\nstdout: ${stdout}\nstderr: ${stderr}`
    assert.ok(out, `${name} printed a JSON result line; ${detail}`)
    assert.ok(out.ok === true && code === 0, `${name} checks passed; ${detail}`)
    assert.match(out.runtime, new RegExp(`^${name.toLowerCase()} \\d`), `${name}: the script ran in ${name}`)
    assertChecks(out, name)
  })
}

test("edge-runtime's EdgeVM runs dist/index.cjs with its own WebSocket: Client, Pool, the login in the upgrade, httpSql", async () => {
  // EdgeRuntime is edge-runtime's EdgeVM (with its fetch-event handling); nothing is passed in:
  // WebSocket, fetch, crypto and timers are the VM's own.
  const vm = new EdgeRuntime()
  assert.equal(vm.evaluate('typeof WebSocket + " " + typeof fetch + " " + typeof crypto.subtle'), 'function function object', 'EdgeVM has WebSocket, fetch and WebCrypto')
  assert.equal(vm.evaluate('typeof process + typeof Buffer + typeof require'), 'undefinedundefinedundefined', 'EdgeVM has no Node globals')
  // The VM evaluates scripts, not modules: the CommonJS build, wrapped as a function.
  const code = readFileSync(new URL('../dist/index.cjs', import.meta.url), 'utf8')
  const mod = vm.evaluate(`globalThis.__edgepg = (function () { const module = { exports: {} }; (function (module, exports) {${code}\n})(module, module.exports); return module.exports })()`)
  assert.ok(typeof mod.Client === 'function' && typeof mod.httpSql === 'function', 'dist/index.cjs evaluated in the EdgeVM exports Client and httpSql')
  vm.evaluate(readFileSync(CHECKS, 'utf8'))
  // The checks run inside the VM; the options cross as JSON, the result comes back as JSON. A script
  // has no import(): what the bundle loads on first use (client-side SCRAM, TLS inside the socket)
  // is for module environments, which is how Vercel's Edge runs bundled code.
  const run = vm.evaluate(`(async () => JSON.stringify(await globalThis.edgepgChecks(globalThis.__edgepg, ${JSON.stringify({ ...smokeOptions(), dynamicImport: false })})))()`)
  const json: string = await within(TIMEOUT_MS, 'the checks in the EdgeVM', run)
  assertChecks(JSON.parse(json), 'edge-runtime', '', false)
})
