/**
 * `--workers n` (issue 23), with real processes: the CLI's primary and its workers accepting on one
 * port, WebSocket sessions and /sql alike; limits that hold for the proxy as a whole (a key's
 * backends at Postgres, sessions per client address); one /metrics for all; a worker killed with
 * SIGKILL replaced while the other's sessions go on; SIGTERM draining every worker.
 */
import { test } from 'node:test'
import assert from 'node:assert/strict'
import { spawn } from 'node:child_process'
import net from 'node:net'
import pg from 'pg'
import { Client } from '../src/index'
import { startChildProxy, type ChildProxy } from './support/child-proxy'
import { edgeConfig, eventually, pgConfig, testPostgres, within } from './support/helpers'
import { PASSWORD } from './support/stack'

const APP = `edgepg-cluster-${process.pid}`

const listening = (p: ChildProxy) => p.lines.filter((l) => l.listening).map((l) => l.pid as number)

async function clusterProxy(flags: string[] = []) {
  const { host, port } = testPostgres()
  const p = await startChildProxy(`${host}:${port}`, { env: { EDGEPG_WORKERS: '2' }, flags: ['--max-sessions-per-ip', '1000', '--shutdown-grace', '2000', ...flags] })
  await eventually(() => new Set(listening(p)).size === 2, 'both workers listening', 15_000)
  return p
}

const session = async (p: ChildProxy) => {
  const c = new Client(edgeConfig(p.port, 'scram_user', { application_name: APP }))
  c.on('error', () => {})
  await c.connect()
  return c
}

test('--workers 2: sessions and /sql on one port, one /metrics for the whole proxy, and a key never holds more than --pool-size backends at Postgres', async () => {
  const p = await clusterProxy(['--pool-size', '4', '--pool-timeout', '10000'])
  const watcher = new pg.Client(pgConfig('trust_user'))
  await watcher.connect()
  try {
    const clients = await Promise.all(Array.from({ length: 16 }, () => session(p)))
    let peak = 0
    let sampling = true
    const sampler = (async () => {
      for (; sampling; await new Promise((r) => setTimeout(r, 20))) {
        const { rows } = await watcher.query('SELECT count(*)::int AS n FROM pg_stat_activity WHERE application_name = $1', [APP])
        peak = Math.max(peak, rows[0].n)
      }
    })()
    await Promise.all(clients.map((c, i) => c.query('SELECT pg_sleep(0.2), $1::int AS i', [i])))
    sampling = false
    await sampler
    assert.ok(peak > 0 && peak <= 4, `Postgres held ${peak} backends for the key, --pool-size 4`)
    const { host, port, database } = testPostgres()
    for (let i = 0; i < 4; i++) {
      const res = await fetch(`http://127.0.0.1:${p.port}/sql`, {
        method: 'POST',
        headers: { 'neon-connection-string': `postgres://scram_user:${PASSWORD}@${host}:${port}/${database}`, 'content-type': 'application/json' },
        body: JSON.stringify({ query: 'SELECT $1::int AS n', params: [i] }),
      })
      assert.equal(res.status, 200, await res.text())
    }
    await Promise.all(clients.map((c) => c.end()))
    // Sessions from both workers in one count: 16 (in whichever worker /metrics was answered by).
    await eventually(async () => {
      const text = await (await fetch(`http://127.0.0.1:${p.port}/metrics`)).text()
      return Number(/^edgepg_proxy_sessions_total\{[^}]*kind="ok"[^}]*\} (\d+)/m.exec(text)?.[1]) === 16
    }, 'the whole proxy’s sessions in /metrics')
    assert.deepEqual(new Set(p.logs.map((l) => l.worker)), new Set([0, 1]), 'both workers served sessions')
  } finally {
    await watcher.end()
    await p.stop()
  }
})

test('--workers 2: --max-sessions-per-ip counts the sessions of every worker', async () => {
  const p = await clusterProxy(['--max-sessions-per-ip', '3'])
  try {
    const clients = await Promise.all(Array.from({ length: 3 }, () => session(p)))
    for (let i = 0; i < 4; i++) await assert.rejects(session(p), /429|too many sessions from/, 'a fourth, on either worker')
    await clients[0].end()
    // Its place is free once the worker has told the primary the session ended.
    let again: Client | undefined
    await eventually(async () => !!(again = await session(p).catch(() => undefined)), 'a place again after one ended')
    await Promise.all([again!, ...clients.slice(1)].map((c) => c.end()))
  } finally {
    await p.stop()
  }
})

test('--workers 2: a worker killed with SIGKILL is replaced; the sessions on the other go on; SIGTERM drains them all', async () => {
  const p = await clusterProxy()
  try {
    // (Many at once, so that the kernel, which hands each connection to one worker, gives both some.)
    const clients = await Promise.all(Array.from({ length: 24 }, () => session(p)))
    const pids = listening(p)
    const victim = pids[0]
    process.kill(victim, 'SIGKILL')
    await eventually(() => p.lines.some((l) => l.exited?.pid === victim && l.replacedBy), 'the worker replaced', 15_000)
    await eventually(() => new Set(listening(p)).size === 3, 'the new worker listening', 15_000)
    // Sessions on the worker that lives answer; those on the killed one failed (their WebSocket went with it).
    const results = await Promise.all(clients.map((c) => c.query('SELECT 1 AS one').then(() => 'ok', () => 'gone')))
    assert.ok(results.includes('ok'), `sessions on the other worker go on: ${results}`)
    const fresh = await Promise.all(Array.from({ length: 4 }, () => session(p)))
    for (const c of fresh) assert.deepEqual((await c.query('SELECT 2 AS two')).rows, [{ two: 2 }])
    const exited = new Promise<number | null>((resolve) => p.child.once('exit', resolve))
    p.child.kill('SIGTERM')
    assert.equal(await within(10_000, 'the proxy to drain and exit', exited), 0)
    await Promise.all([...clients, ...fresh].map((c) => c.end().catch(() => {})))
  } finally {
    await p.stop()
  }
})

test('--workers 2 on a port already taken: the workers cannot listen, and the proxy exits 2 saying so (no respawning)', async () => {
  const taken = net.createServer()
  await new Promise<void>((resolve) => taken.listen(0, '127.0.0.1', resolve))
  const port = (taken.address() as net.AddressInfo).port
  try {
    const { host, port: pgPort } = testPostgres()
    const child = spawn(process.execPath, ['--import', 'tsx', 'proxy/cli.ts', '--upstream', `${host}:${pgPort}`, '--listen', `127.0.0.1:${port}`, '--workers', '2'], { stdio: ['ignore', 'pipe', 'pipe'] })
    let out = ''
    child.stdout!.on('data', (d) => (out += d))
    child.stderr!.on('data', (d) => (out += d))
    const code = await within(20_000, 'the proxy to give up', new Promise((resolve) => child.once('exit', resolve)))
    assert.equal(code, 2, out)
    assert.match(out, /cannot listen on 127\.0\.0\.1:\d+: \w+ EADDRINUSE/)
    assert.ok((out.match(/"replacedBy"/g) ?? []).length === 0, `no worker was replaced: ${out}`)
  } finally {
    taken.close()
  }
})
