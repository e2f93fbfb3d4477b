# Builds tests/consumer/consumer_c.c against an installed kvevict with nothing but pkg-config and
# the C compiler, and runs it. -DPREFIX=<install prefix> -DSOURCE=<consumer_c.c> -DWORK=<dir>
# -DCC=<C compiler> -DLIBDIR=<lib dir name>
find_program(PKG_CONFIG NAMES pkg-config pkgconf REQUIRED)
set(ENV{PKG_CONFIG_PATH} "${PREFIX}/${LIBDIR}/pkgconfig")
execute_process(COMMAND ${PKG_CONFIG} --static --cflags --libs kvevict-c
                OUTPUT_VARIABLE flags OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "pkg-config does not know kvevict-c under ${PREFIX}")
endif()
separate_arguments(flags UNIX_COMMAND "${flags}")
file(MAKE_DIRECTORY ${WORK})
execute_process(COMMAND ${CC} ${SOURCE} ${flags} ${EXTRA_FLAGS} -o ${WORK}/consumer_c_pkg_config
                RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "consumer_c.c did not build with the flags of kvevict-c.pc: ${flags}")
endif()
execute_process(COMMAND ${WORK}/consumer_c_pkg_config RESULT_VARIABLE status)
if(NOT status EQUAL 0)
  message(FATAL_ERROR "consumer_c built with pkg-config failed")
endif()
