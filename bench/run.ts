/**
 * `npm run bench`: starts a throwaway Postgres and an edgepg-proxy, runs every benchmark section
 * (each prints its own table), then stops both, whatever happened.
 *
 *   npx tsx bench/run.ts [section ...] [--proxy=child|in-process]
 *
 * Sections are named on the command line to run only those (e.g. `core`). The proxy runs as a
 * child process by default, like a real deployment; `--proxy=in-process` shares this process.
 */
import os from 'node:os'
import { WebSocket } from 'ws'
import { SetupError } from '../test/support/pg-server'
import { PASSWORD, startPostgres } from '../test/support/stack'
import { connect } from './connect'
import { sessions } from './sessions'
import { core } from './core'
import { proxycost } from './proxycost'
import { loadBench } from './load'
import { httpBench } from './http'
import { bundle } from './bundle'
import { stop } from './stop'
import { workerd } from './workerd'
import { attack } from './attack'
import { pool } from './pool'
import { workers } from './workers'
import { isolation } from './isolation'
import { where } from './where'
import { regions } from './regions'
import { crowd } from './crowd'
import { firstLogin } from './first-login'
import { poolWays } from './pool-ways'
import { listen } from './listen'
import { passes, type BenchContext, type ProxyMode, type Row, type Section } from './lib'
import { startProxy, type RunningProxy } from './proxy'

const SECTIONS: Section[] = [core, connect, sessions, proxycost, loadBench]
SECTIONS.push(httpBench, bundle, stop, workerd, attack, pool, workers, isolation, where, regions, crowd, firstLogin, poolWays, listen)

const args = process.argv.slice(2)
const proxyArg = args.find((a) => a.startsWith('--proxy='))?.slice('--proxy='.length) ?? 'child'
if (proxyArg !== 'child' && proxyArg !== 'in-process') {
  console.error(`bench: --proxy must be child or in-process, got "${proxyArg}"`)
  process.exit(2)
}
const proxyMode: ProxyMode = proxyArg
const wanted = args.filter((a) => !a.startsWith('--'))
const unknown = wanted.filter((w) => !SECTIONS.some((s) => s.name === w))
if (unknown.length) {
  console.error(`bench: unknown section(s) ${unknown.join(', ')}; known: ${SECTIONS.map((s) => s.name).join(', ')}`)
  process.exit(2)
}
const sections = wanted.length ? SECTIONS.filter((s) => wanted.includes(s.name)) : SECTIONS

const cpus = os.cpus()
console.log('# edgepg benchmarks\n')
console.log(`node ${process.version} on ${process.platform}/${process.arch}, ${cpus.length} CPU(s): ${cpus[0]?.model.trim() ?? '?'}`)
console.log(`embedded PostgreSQL 18 on 127.0.0.1; edgepg-proxy ${proxyMode === 'child' ? 'in a child process (as deployed)' : 'in this process (--proxy=in-process)'}`)
const load = () => os.loadavg().map((x) => x.toFixed(2)).join(' ')
console.log(`load average at start: ${load()}${os.loadavg()[0] > cpus.length / 2 ? '  (busy machine: expect noisy numbers)' : ''}`)

let pgStack: Awaited<ReturnType<typeof startPostgres>> | undefined
let proxy: RunningProxy | undefined
let stopping: Promise<void> | undefined
const stopAll = () =>
  (stopping ??= (async () => {
    await proxy?.stop().catch(() => {})
    await pgStack?.stop().catch(() => {})
  })())
for (const signal of ['SIGINT', 'SIGTERM'] as const) {
  process.once(signal, () => void stopAll().then(() => process.exit(130)))
}
// An error outside any awaited promise (e.g. a stray 'error' event) still stops Postgres and the proxy.
const crash = (err: unknown) => {
  console.error('\nbench crashed:', err)
  void stopAll().then(() => process.exit(1))
}
process.on('uncaughtException', crash)
process.on('unhandledRejection', crash)

let exitCode = 0
const started = performance.now()
try {
  pgStack = await startPostgres()
  proxy = await startProxy(`${pgStack.host}:${pgStack.port}`, proxyMode)
  const info = { host: pgStack.host, port: pgStack.port, database: pgStack.database }
  const pgConfig = () => ({ ...info, user: 'scram_user', password: PASSWORD })
  const ctx: BenchContext = {
    pg: info,
    proxy: { port: proxy.port, url: proxy.url, mode: proxy.mode },
    pgConfig,
    edgeConfig: () => ({ ...pgConfig(), webSocketConstructor: WebSocket as any, wsProxy: () => proxy!.url }),
  }
  const all: Row[] = []
  for (const section of sections) all.push(...(await section.run(ctx)))
  const missed = all.filter((r) => !passes(r))
  const targeted = all.filter((r) => r.target !== undefined)
  console.log(`\n${targeted.length - missed.length}/${targeted.length} targets met${missed.length ? `; missed: ${missed.map((r) => r.metric).join('; ')}` : ''}`)
} catch (err) {
  console.error(err instanceof SetupError ? `npm run bench: ${err.message}` : `\nbench failed: ${(err as Error).stack ?? err}`)
  exitCode = 1
} finally {
  await stopAll()
  console.log(`load average at end: ${load()}; took ${((performance.now() - started) / 1000).toFixed(1)} s`)
}
process.exit(exitCode)
