/**
 * Shared pieces of the benchmark runner: the context every section receives, statistics, and
 * the one table format all sections print.
 */
import { readdirSync } from 'node:fs'
import v8 from 'node:v8'
import vm from 'node:vm'
import type pg from 'pg'
import type { ClientConfig } from '../src/index'
import type { PgInfo } from '../test/support/stack'
import { procStat } from '../test/support/child-proxy'

export interface BenchContext {
  /** The embedded Postgres every section measures against. */
  pg: PgInfo
  /** The edgepg-proxy relaying to it. */
  proxy: { port: number; url: string; mode: ProxyMode }
  /** pg-over-TCP config straight to Postgres (role scram_user). */
  pgConfig(): pg.ClientConfig
  /** edgepg config reaching the same Postgres through the proxy (role scram_user). */
  edgeConfig(): ClientConfig
}

export type ProxyMode = 'child' | 'in-process'

/** One benchmark section: measures, prints its table, and reports its rows for the summary. */
export interface Section {
  name: string
  run(ctx: BenchContext): Promise<Row[]>
}

export interface Row {
  metric: string
  edgepg: string
  baseline: string
  /** edgepg / baseline; undefined when the metric has no ratio. */
  ratio?: number
  /** Largest passing ratio; undefined when the metric has no target. */
  target?: number
}

export const passes = (row: Row) => row.target === undefined || row.ratio === undefined || row.ratio <= row.target

export function median(xs: number[]): number {
  return percentile(xs, 50)
}

/** Nearest-rank percentile (p in 0..100). */
export function percentile(xs: number[], p: number): number {
  if (!xs.length) return NaN
  const sorted = [...xs].sort((a, b) => a - b)
  const rank = Math.ceil((p / 100) * sorted.length)
  return sorted[Math.min(sorted.length - 1, Math.max(0, rank - 1))]
}

export const ms = (x: number, digits = x < 10 ? 3 : x < 100 ? 2 : 1) => `${x.toFixed(digits)} ms`

/** Prints rows as an aligned table under a title; notes follow the table. */
export function printTable(title: string, rows: Row[], baselineName = 'pg (TCP)', notes: string[] = []) {
  const header = ['metric', 'edgepg', baselineName, 'ratio', 'target', 'result']
  const cells = rows.map((r) => [
    r.metric,
    r.edgepg,
    r.baseline,
    r.ratio === undefined ? '' : `${r.ratio.toFixed(2)}x`,
    r.target === undefined ? '' : `<= ${r.target.toFixed(2)}x`,
    r.target === undefined ? '' : passes(r) ? 'pass' : 'MISS',
  ])
  printGrid(title, header, cells, notes)
}

/** Runs `fn` for each key in turn for `rounds` rounds, rotating which goes first each round. */
export async function interleave<K extends string>(keys: readonly K[], rounds: number, fn: (key: K, round: number) => Promise<void>) {
  for (let round = 0; round < rounds; round++) {
    const order = round % 2 === 0 ? [...keys] : [...keys].reverse()
    for (const key of order) await fn(key, round)
  }
}

/**
 * CPU seconds (user + system: /proc/<pid>/stat fields 14 and 15, in ticks of 10 ms) used so far by
 * `pid` and every live process below it (a cluster primary's workers), or only those of them named
 * `comm` (e.g. the PgBouncer this process started: treeCpuSeconds(process.pid, 'pgbouncer')).
 */
export function treeCpuSeconds(pid: number, comm?: string): number {
  return [...treeCpu(pid, comm).values()].reduce((a, b) => a + b, 0)
}

/** treeCpuSeconds by process (pid -> CPU seconds), for cpuBetween. */
export function treeCpu(pid: number, comm?: string): Map<number, number> {
  const procs = readdirSync('/proc').filter((d) => /^\d+$/.test(d)).flatMap((d) => {
    try {
      return [{ pid: Number(d), ...procStat(Number(d)) }]
    } catch {
      return [] // (ended meanwhile)
    }
  })
  const tree = new Set([pid])
  for (let grew = true; grew; ) {
    grew = false
    for (const p of procs) if (tree.has(p.ppid) && !tree.has(p.pid)) tree.add(p.pid), (grew = true)
  }
  return new Map(procs.filter((p) => tree.has(p.pid) && (comm === undefined || p.comm === comm)).map((p) => [p.pid, p.cpuSeconds]))
}

/**
 * CPU seconds a tree used between two treeCpu snapshots (a process new in the second counted whole), and how many
 * processes started and ended in between: an ended one's time in the window is lost, not its whole life's subtracted
 * (as a difference of treeCpuSeconds would).
 */
export function cpuBetween(before: Map<number, number>, after: Map<number, number>): { seconds: number; started: number; ended: number } {
  const seconds = [...after].reduce((sum, [pid, s]) => sum + s - (before.get(pid) ?? 0), 0)
  return { seconds, started: [...after.keys()].filter((pid) => !before.has(pid)).length, ended: [...before.keys()].filter((pid) => !after.has(pid)).length }
}

/** A full garbage collection, so one run's garbage is not collected during the next one's timing. */
export const gc: () => void = (() => {
  const exposed = (globalThis as any).gc
  if (typeof exposed === 'function') return exposed
  try {
    // --expose-gc can be turned on at run time; the gc function then exists in new contexts.
    v8.setFlagsFromString('--expose-gc')
    return vm.runInNewContext('gc')
  } catch {
    return () => {}
  }
})()

/**
 * Prints a free-form table (first column left-aligned, the rest right-aligned) under a title,
 * for sections comparing more than two drivers; notes follow the table.
 */
export function printGrid(title: string, header: string[], cells: string[][], notes: string[] = []) {
  const widths = header.map((h, i) => Math.max(h.length, ...cells.map((c) => (c[i] ?? '').length)))
  const line = (c: string[]) => '| ' + widths.map((w, i) => (i === 0 ? (c[i] ?? '').padEnd(w) : (c[i] ?? '').padStart(w))).join(' | ') + ' |'
  const rule = '|' + widths.map((w, i) => (i === 0 ? '-'.repeat(w + 1) + '-' : '-'.repeat(w + 1) + ':')).join('|') + '|'
  console.log(`\n## ${title}\n`)
  console.log(line(header))
  console.log(rule)
  for (const c of cells) console.log(line(c))
  for (const n of notes) console.log(`\n${n}`)
}
