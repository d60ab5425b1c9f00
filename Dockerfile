# edgepg-proxy in a container, built from this repository: docker build -t edgepg-proxy .
# (Not built in edgepg's own tests: no container engine runs there. test/docker.test.ts runs its
# ENTRYPOINT and HEALTHCHECK command lines as written, outside a container.)

FROM node:20-bookworm-slim AS build
WORKDIR /app
COPY package.json package-lock.json ./
RUN npm ci --ignore-scripts --no-audit --no-fund
COPY . .
RUN npm run build

FROM node:20-bookworm-slim
ENV NODE_ENV=production
WORKDIR /app
COPY package.json package-lock.json ./
RUN npm ci --omit=dev --ignore-scripts --no-audit --no-fund && npm cache clean --force
COPY --from=build /app/dist ./dist
# Settings come from the environment (EDGEPG_*, deploy/edgepg-proxy.env lists them all): at least
# EDGEPG_UPSTREAM. The admin listener is for the container's network only: do not publish it.
ENV EDGEPG_LISTEN=0.0.0.0:8080 \
    EDGEPG_ADMIN_LISTEN=0.0.0.0:9464
EXPOSE 8080
USER node
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["node", "-e", "fetch('http://127.0.0.1:9464/healthz').then((r) => process.exit(r.ok ? 0 : 1), () => process.exit(1))"]
# node itself is PID 1: SIGTERM (docker stop) drains sessions for --shutdown-grace (10 s; give
# docker stop --time more), SIGHUP reloads the certificate, SIGUSR2 hands over to new workers.
STOPSIGNAL SIGTERM
ENTRYPOINT ["node", "dist/cli.mjs"]
